"""Markdown tables and JSON results, as the benchmark scripts print and write them."""

from __future__ import annotations

import json
import os
import platform


def md_head(*cols: str) -> str:
    """A markdown table's header and its rule: `| a | b |` over `|---|---|`."""
    return md_row(*cols) + "\n" + "|---" * len(cols) + "|"


def md_row(*cells) -> str:
    """One row of a markdown table, each cell as given (formatted by the caller)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def write_json(folder: str, name: str, obj) -> str:
    """obj as JSON (indent 1) in folder/name; returns the path."""
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


def machine_line() -> str:
    """The first line of a CPU benchmark's report: the host, its CPUs, Python and the load."""
    return (f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.2f}")
