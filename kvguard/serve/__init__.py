"""`kvguard serve-llm`: an OpenAI-compatible inference server whose KV cache is kvguard's.

    protocol.py   the OpenAI request bodies, validated
    scheduler.py  requests, their page reservations, the waiting and running sets
    engine.py     the batching loop: prefill chunks and batched decode steps over one CacheManager
    keys.py       bearer API keys (`infer` scope, one tenant) checked with the sidecar
    app.py        the FastAPI application: routes, SSE, problem+json, metrics
    cli.py        the command line

Every request is a sequence of the shared CacheManager owned by (the key's tenant, the
request's `user`, its session); its events stream to the sidecar through a SidecarClient.
"""
