"""Torch work off the model's thread, on threads that end with it.

On the CPU each thread that runs torch's parallel work (an operator over enough elements, every
oneDNN matrix product) keeps a team of OpenMP threads for as long as it lives, and libgomp makes
every team sleep between parallel regions instead of spinning once the teams' threads outnumber
the CPUs. A second team beside the model's made each matrix product of a decode batch ~1.6x
slower on 2 CPUs (88 against 142-152 us for a 576x1536 product of 8 rows), and serve-llm's steps
with it. torch's thread count is one for the whole process, so the other threads cannot be given
fewer: work that needs torch beside a running model (loading it, an erasure's page writes) runs
on a thread of its own that ends when the work does, and its team ends with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_a_thread(fn: Callable[[], T], name: str = "kvguard-work") -> T:
    """fn() on a new thread, waited for: its result, or its exception raised here."""
    out: dict = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            out["error"] = e

    t = threading.Thread(target=call, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
