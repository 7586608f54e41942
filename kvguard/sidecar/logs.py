"""Structured logs: JSON in production, readable in a terminal, a request id on every line.

A processor redacts any field whose name says it may hold a secret or a raw
subject id, whatever code logged it.
"""

from __future__ import annotations

import logging
import sys

import structlog

REDACT = ("token", "authorization", "secret", "password", "key", "tenant", "user", "session", "subject",
          "prompt", "text")


def _redact(_, __, event_dict: dict) -> dict:
    for name in list(event_dict):
        low = name.lower()
        if name != "event" and any(word in low for word in REDACT) and not low.endswith(("_id_hash", "pseudonym")):
            if low in ("request_id", "key_id", "idempotency_key_hash"):
                continue
            event_dict[name] = "<redacted>"
    return event_dict


def _stderr_logger(*_args) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # stderr as it is when a line is written, not when this ran: a replaced stream (a test's
        # capture, a daemon's redirect) never leaves the logger writing to a closed file
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


log = structlog.get_logger("kvguard")
