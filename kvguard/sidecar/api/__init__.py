"""The admin REST API (/v1) and the internal ingest API of inference processes."""
