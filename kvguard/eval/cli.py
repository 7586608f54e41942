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
attention-output relative deviation ||O'-O||/||O|| per layer (mean and worst layer)
against the same K/V uncompressed, perplexity and its change (absolute and relative),
the KL divergence of the next-token distributions and top-1 agreement against the
uncompressed cache at every scored position, greedy agreement (information only),
time to first token and decode tokens/s, with ranges over the texts; then each
policy's calibration (accept, downgrade or refuse against its fidelity bound). An
evictor that never fires at the run's length is reported "evictor not measured",
never PASS (--fire-evictors measures it at a length where it does). Writes fidelity.md, .csv, .json and a
self-contained .html with plots into --out. With --probe, also a retrieval probe: a pass
key planted at several depths of a --probe-length prompt of real text, asked for at
the end and generated greedily through each configuration's cache; the column
"retrieval" counts the keys found (reported, not gated). The protocol is in
docs/fidelity.md."""

EPILOG = """\
methods: none int8 int8-window int4 fp8 int8-rot int8-window-rot fp8-rot int4-rot int4-rot-g64
         int4-rot-w512 h2o streamingllm snapkv h2o-prefix streamingllm-prefix
         snapkv-prefix h2o-shared snapkv-shared h2o-shared-prefix snapkv-shared-prefix
         h2o-head-prefix snapkv-head-prefix sparse kvsplit@5 kvsplit@10 kvsplit@25 kvsplit@50
         and only when named (budgets, docs/fidelity.md): h2o-value snapkv-value h2o-value-prefix
         snapkv-value-prefix, and h2o-/snapkv- pyramid, adaptive, pyramid-adaptive, global, each -prefix
         or -value-prefix (e.g. snapkv-adaptive-value-prefix); kvsplit-all@5 .. @50 (the pages a
         query does not read keep their weight in its softmax); kvsplit-bound@5 .. @50 (pages
         ranked by Quest's bound), kvsplit-bound-r4@ and -r8@5 .. @50 (the bound's top 4 or 8 x, then exact);
         int8+kvsplit@F, int8+kvsplit4@F, int8-rot+kvsplit4@F, F = 5, 10, 25, 50, 100 (INT8 pages, the
         split's keys INT8 or INT4); h2o-pages snapkv-pages (each head's whole pages dropped first)
texts:   austen (Debian r-cran-janeaustenr), python-docs (Debian python3.11-doc),
         stdlib-code (this Python's standard library), python-howto (held out: three
         HOWTOs from python3.11-doc, not a default text); Debian texts are fetched with
         'apt-get download' into --text-cache once.
example: kvguard eval --methods none,int8,int4 --texts stdlib-code --prefix 512 --score 512
         kvguard eval --probe --from-json docs/fidelity/fidelity.json --out DIR  (only the probe,
         for every configuration of an earlier report)"""


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {value!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .settings import ProbeSettings, Settings

    d, pd = Settings(), ProbeSettings()
    p.add_argument("--model", metavar="PATH", help="smollm2 or gemma3 (the GGUFs of their wheels, "
                   "docs/models.md), a .gguf file or a local transformers model folder (default: smollm2)")
    p.add_argument("--texts", type=_csv, default=["austen", "python-docs", "stdlib-code"], metavar="A,B",
                   help="built-in texts, comma-separated (default: austen,python-docs,stdlib-code)")
    p.add_argument("--text-file", action="append", default=[], metavar="PATH",
                   help="also a text file (repeatable); with --texts '' only the files")
    p.add_argument("--text-cache", metavar="DIR", help="where Debian texts are kept (default ~/.cache/kvguard/texts)")
    p.add_argument("--methods", type=_csv, metavar="A,B",
                   help="built-in methods, comma-separated (default: all but the budget methods; 'none' always "
                        "runs as the reference)")
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
    p.add_argument("--max-layer-deviation", type=float, default=None,
                   help="gate for built-in methods: bound on the worst layer's deviation "
                        "(default 3x --max-deviation: 0.03)")
    p.add_argument("--max-ppl-increase-rel", type=float, default=None,
                   help="gate for built-in methods: bound on ΔPPL / PPL (0.01 = 1 %%; default none)")
    p.add_argument("--fire-evictors", action="store_true",
                   help="measure a configuration whose evictor would not fire at --prefix + --score with a "
                        "prefix of its budget instead (and the reference at that length), where the model's "
                        "context holds it; slow: the chat policy's 4,096 tokens take several times the default run")
    p.add_argument("--out", default="fidelity-report", metavar="DIR", help="output folder (default fidelity-report)")
    p.add_argument("--formats", type=_csv, default=["md", "csv", "json", "html"], metavar="A,B",
                   help="which of md,csv,json,html to write (default: all)")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: render the report again from an earlier fidelity.json")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the harness runs many small tensor operations, which "
                        "more threads slow down, by 5x on a busy 2-core machine; 0 = torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", nargs="+", metavar="REPORT.json",
                   help="measure nothing: lay out fidelity.json reports of several models side by side (each "
                        "gated on its own model) and write side-by-side.md into --out")
    g = p.add_argument_group("retrieval probe (pass key in a haystack; docs/fidelity.md)")
    g.add_argument("--probe", action="store_true",
                   help="also run the retrieval probe for every configuration measured; with --from-json, only "
                        "the probe, for every configuration of that report (--policies as it was measured) or "
                        "those of --methods (rows and policy steps by name; the others keep their retrieval)")
    g.add_argument("--probe-length", type=int, default=pd.length,
                   help=f"tokens of each prompt, chat template and question included (default {pd.length})")
    g.add_argument("--probe-depths", type=_ints, default=list(pd.depths), metavar="A,B",
                   help="where the key sits, in percent of the filler (default "
                        f"{','.join(map(str, pd.depths))})")
    g.add_argument("--probe-seeds", type=int, default=pd.seeds,
                   help=f"prompts per depth, each with its own key and stretch of text (default {pd.seeds})")
    g.add_argument("--probe-chunk", type=int, default=pd.chunk,
                   help="context tokens per forward pass after the first --budget, so that continuous evictors "
                        f"compact while the prompt is read (default {pd.chunk})")
    g.add_argument("--probe-text", metavar="NAME",
                   help="the filler: a built-in text (default: the first of --texts, else austen)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import ConfigError
    from ..policy import Fidelity, load_policies
    from . import report
    from .evaluate import evaluate
    from .methods import builtin_methods, select
    from .settings import Settings
    from .texts import load_texts

    if args.compare:
        from .compare import load_reports, side_by_side

        text = side_by_side(load_reports(args.compare))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "side-by-side.md").write_text(text, encoding="utf-8")
        print(text, end="")
        return 0
    bad = set(args.formats) - {"md", "csv", "json", "html"}
    if bad:
        raise ConfigError(f"unknown format(s) {sorted(bad)}; choose from md, csv, json, html")
    probe = _probe_settings(args) if args.probe else None
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.from_json:
        try:
            data = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {args.from_json}: {getattr(e, 'strerror', None) or e}; give the "
                              "fidelity.json an earlier run wrote") from None
        result = report.from_json(data)
        if probe:
            _probe(result, args, probe, list(load_policies(args.policies).values()) if args.policies else [])
        return _write(result, args)
    if not 0 < args.max_deviation < 1:
        raise ConfigError(f"--max-deviation must be between 0 and 1 (0.01 = 1 %), got {args.max_deviation}")
    if not args.max_ppl_increase > 0:
        raise ConfigError(f"--max-ppl-increase must be above 0, got {args.max_ppl_increase}")
    if args.max_layer_deviation is not None and not args.max_deviation <= args.max_layer_deviation < 1:
        raise ConfigError(f"--max-layer-deviation must be at least --max-deviation ({args.max_deviation}) and "
                          f"below 1, got {args.max_layer_deviation}")
    if args.max_ppl_increase_rel is not None and not args.max_ppl_increase_rel > 0:
        raise ConfigError(f"--max-ppl-increase-rel must be above 0, got {args.max_ppl_increase_rel}")
    settings = Settings(prefix=args.prefix, score=args.score, chunk=args.chunk, generate=args.generate,
                        budget=args.budget, page_size=args.page_size, dtype=args.cache_dtype)
    available = builtin_methods(args.budget, args.page_size)
    methods = select(args.methods or [n for n, m in available.items() if m.default], available)
    if args.policies and not Path(args.policies).is_dir():
        raise ConfigError(f"no folder {args.policies} of policies to calibrate; give --policies DIR, "
                          "or --policies '' for none")
    policies = list(load_policies(args.policies).values()) if args.policies else []
    texts = load_texts(args.texts, args.text_file, args.text_cache)
    if not texts:
        raise ConfigError("no text to measure on: give --texts or --text-file")
    model, tokenizer, name = _model(args)
    result = evaluate(model, tokenizer, texts, methods, settings, policies,
                      bound=Fidelity(max_attention_deviation=args.max_deviation,
                                     max_ppl_increase=args.max_ppl_increase,
                                     max_layer_deviation=args.max_layer_deviation,
                                     max_ppl_increase_rel=args.max_ppl_increase_rel),
                      model_name=name, progress=not args.quiet, fire_evictors=args.fire_evictors)
    if probe:
        _probe(result, args, probe, policies, texts.get(probe.text))
    return _write(result, args)


def _model(args: argparse.Namespace):
    from ..hf.model import MODELS, SOURCES, load_model

    name = args.model or "smollm2"
    path = MODELS[name]() if name in MODELS else Path(name)
    model, tokenizer = load_model(str(path)) if path.suffix == ".gguf" or name in MODELS else _load_folder(path)
    return model, tokenizer, (SOURCES[name]() if name in SOURCES else path).name


def _probe_settings(args: argparse.Namespace):
    from ..errors import ConfigError
    from .settings import ProbeSettings
    from .texts import BUILTIN

    text = args.probe_text or next((t for t in args.texts if t in BUILTIN), "austen")
    if text not in BUILTIN:
        raise ConfigError(f"unknown --probe-text {text!r}; choose from {list(BUILTIN)}")
    return ProbeSettings(length=args.probe_length, depths=tuple(args.probe_depths), seeds=args.probe_seeds,
                         chunk=args.probe_chunk, text=text)


def _probe(result, args: argparse.Namespace, probe, policies, filler: str | None = None) -> None:
    """The retrieval probe for every configuration of `result`, into it."""
    from ..errors import ConfigError
    from .methods import builtin_methods
    from .needle import add_retrieval, methods_for
    from .texts import load_texts

    s = result.settings
    if probe.length < 2 * (s.budget + s.page_size):
        raise ConfigError(f"--probe-length {probe.length} is too short for --budget {s.budget}: give at least "
                          f"{2 * (s.budget + s.page_size)}, so that the evictors drop most of the prompt")
    only = None
    if args.from_json and args.methods:  # only these rows; the others keep what an earlier probe found
        only = set(args.methods)
        unknown = sorted(only - {r.method for r in result.summaries})
        if unknown:
            raise ConfigError(f"--methods {unknown} are not in {args.from_json}")
    methods = methods_for(result.summaries, builtin_methods(s.budget, s.page_size), policies)
    if filler is None:
        filler = load_texts([probe.text], cache_dir=args.text_cache)[probe.text]
    model, tokenizer, _ = _model(args)
    add_retrieval(result, model, tokenizer, filler, methods, probe, progress=not args.quiet, only=only)


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
