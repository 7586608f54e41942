"""`kvguard serve-llm`: load a model, open its cache beside the sidecar, serve the OpenAI API."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DESCRIPTION = """\
Serve a transformers causal LM over an OpenAI-compatible HTTP API (chat completions, completions,
models; streaming SSE), with continuous batching, its KV cache in kvguard's pages and every cache
operation audited by the kvguard sidecar ('kvguard serve'), reached over its ingest socket.

Callers send 'Authorization: Bearer <key>' with a key from
  kvguard token create --scope infer --tenant TENANT
and name their end user in the OpenAI 'user' field; a session may be named in X-Session-ID.
The process itself authenticates to the sidecar with an ingest token, read from the
KVGUARD_INGEST_TOKEN variable or --ingest-token-file (never from the command line).

With --upstream URL instead of --model, the same front runs before a vLLM OpenAI server whose
KV cache kvguard's connector audits and erases (docs/vllm.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model",
                   help="a local model folder or a GGUF file; 'smollm2' and 'gemma3' are the GGUFs of their "
                        "wheels (docs/models.md; not with --upstream)")
    p.add_argument("--upstream", metavar="URL",
                   help="serve through a vLLM OpenAI server at URL instead of kvguard's engine: the same front, "
                        "each request given a cache_salt and its subject for kvguard's connector inside vLLM "
                        "(docs/vllm.md)")
    p.add_argument("--upstream-model", help="the model's name at the upstream (default: --served-model-name)")
    p.add_argument("--prefix-sharing", choices=["tenant", "user", "session"], default="tenant",
                   help="with --upstream: who shares prefix blocks, by the salt vLLM keys them under "
                        "(default tenant)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: 'smollm2' or 'gemma3', or the "
                                               "model file's or folder's name)")
    p.add_argument("--policy", type=Path, help="a scenario policy (policies/*.yaml): codec, evictor, prefix "
                                               "sharing; default: 16-bit pages, tenant prefix sharing")
    p.add_argument("--fidelity", type=Path, help="a 'kvguard eval' report (JSON) that measured the policy on this "
                                                 "model: the policy runs as its fidelity gate decided there "
                                                 "(accepted, downgraded, or refused: the server does not start)")
    p.add_argument("--codec", choices=["fp16", "int8", "int4", "fp8"], help="override the policy's codec")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="model and KV dtype (default: bfloat16 on CUDA and on CPUs with AVX512-BF16 or "
                   "AMX-BF16, float32 on other CPUs)")
    p.add_argument("--num-pages", type=int, default=2048, help="KV pages of the codec's pool (default 2048)")
    p.add_argument("--split-pages", type=int, default=None,
                   help="pages of the K/V split's pool, for a policy with kv_split: each holds its keys in device "
                        "memory (about half a page) and its values in pinned host memory (default: --num-pages)")
    p.add_argument("--max-seqs", type=int, default=64, help="requests running at once; more wait (default 64)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="requests waiting for a place; more get 429 with Retry-After (default: --max-seqs x 3)")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens per prefill chunk (default 256)")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--warmup", type=int, default=0, metavar="TOKENS",
                   help="before listening, serve --max-seqs requests of this many prompt tokens once, so that "
                        "the kernels and CUDA graphs of those shapes are made at start-up and not on the first "
                        "requests (their sequences are recorded and erased; default 0: none)")
    p.add_argument("--default-user", help="the end user of requests that send no 'user' (default: such "
                                          "requests get 400)")
    p.add_argument("--socket", type=Path, help="the sidecar's ingest socket (KVGUARD_SOCKET; default "
                                               "./.data/ingest.sock)")
    p.add_argument("--ingest-token-file", type=Path, help="file holding the ingest token (else KVGUARD_INGEST_TOKEN)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds a request's headers and body have to arrive; a slower one gets 408 and its "
                        "connection is closed (default 10)")
    p.add_argument("--max-idle-connections", type=int, default=512,
                   help="connections held without a request running (new, kept alive, or still sending one); "
                        "past it the oldest of them is closed (default 512)")


def load(model: str, device: str | None, dtype: str | None, rows: int = 8):
    """(model, tokenizer, served name). On the CPU the model's linear layers multiply through
    oneDNN over weights reordered once for batches of `rows` (kvguard.hf.cpu)."""
    import torch

    from ..hf.cpu import default_dtype
    from ..hf.model import MODELS, load_model

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else default_dtype())
    path = str(MODELS[model]()) if model in MODELS else model
    if path.endswith(".gguf"):
        m, tok = load_model(path, dt)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..hf import register

        register()
        tok = AutoTokenizer.from_pretrained(path)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="kvguard").eval()
    name = model if model in MODELS else Path(path).stem if path.endswith(".gguf") else Path(path).name
    m = m.to(dev)
    if dev.type == "cpu":
        from ..hf.cpu import pack_linears

        packed = pack_linears(m, rows)
        print(f"kvguard serve-llm: {packed} linear layers packed for oneDNN ({str(dt)[6:]})" if packed else
              "kvguard serve-llm: oneDNN cannot pack this model's linear layers here; they run unpacked",
              file=sys.stderr)
    return m, tok, name


def gate(policy, report: Path):
    """The policy as its fidelity gate decided in a `kvguard eval` report (its JSON): the step in
    force, and the decision, to be recorded. A refused policy, or a report that measured
    another configuration than the policy file's, is a ConfigError."""
    import json

    from ..errors import ConfigError
    from ..policy import PolicyDecision
    from ..types import Subject

    try:
        decisions = json.loads(Path(report).read_text())["decisions"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{report} is no kvguard eval report (JSON with decisions): {e}") from None
    found = [d for d in decisions if isinstance(d, dict) and d.get("policy") == policy.name]
    if not found:
        raise ConfigError(f"{report} has no decision on policy {policy.name!r}: run kvguard eval with it")
    d = found[-1]
    steps = policy.steps()
    if d.get("outcome") == "refuse" or not isinstance(d.get("step"), int) or d["step"] < 0:
        raise ConfigError(f"policy {policy.name!r} was refused by its fidelity gate ({report}): serve a safer one")
    # the configuration measured, wherever the policy now holds it: a step added before it since
    # (a bolder one, not measured) is skipped, never served unmeasured
    keys = [step.key for step in steps]
    if d.get("config") not in keys:
        raise ConfigError(f"{report} measured {d.get('config')!r} for policy {policy.name!r}, which the policy "
                          "file no longer holds: measure it again")
    at = keys.index(d["config"])
    decision = PolicyDecision.from_details(d | {"step": at}, Subject("*", "*", "*"))
    return policy.at(at), decision


def cache_manager(model, *, policy: Path | None = None, codec: str | None = None, num_pages: int = 2048,
                  num_hot_pages: int | None = None, fidelity: Path | None = None, split_pages: int | None = None):
    """(the CacheManager for a model's K/V, the name of the policy in force). Without a policy:
    16-bit pages, prompt pages shared within a tenant. With `fidelity` (a `kvguard eval` report)
    the policy runs as its gate decided there (accepted, or downgraded to a step), and the
    decision goes to the audit log. `split_pages`: the K/V split's pool, for a policy that
    splits (default as many pages as the codec's pool; their keys take device memory, their
    values pinned host memory)."""
    from ..cache import CacheConfig, open_manager
    from ..errors import ConfigError
    from ..hf.cache import layer_windows, shape_fields
    from ..policy.schema import load_policy

    param = next(model.parameters())
    opts: dict = {"prefix_sharing": True}
    name = "none"
    decision = None
    if fidelity is not None and policy is None:
        raise ConfigError("--fidelity gates a policy: give --policy too")
    if policy is not None:
        pol = load_policy(policy)
        if fidelity is not None:
            pol, decision = gate(pol, fidelity)
            name = pol.name if decision.outcome == "accept" else f"{pol.name} (downgraded to step {decision.step})"
        else:
            name = f"{pol.name} (not measured)"
        opts = pol.cache_options() | {"tiers": None}  # lower tiers are the sidecar's; none is given here
    if codec is not None:
        opts["codec"] = codec
        if codec != "int8" or "codec_options" not in opts:
            opts["codec_options"] = {}
        name = f"{name}+codec={codec}"
    if split_pages is not None:
        if not opts.get("kv_split"):
            raise ConfigError(f"--split-pages sizes the K/V split, but the cache in force ({name}) does not split "
                              "K/V: drop it, or use a policy with kv_split")
        opts["kv_split"] = {**opts["kv_split"], "capacity": split_pages}
    # a model of sliding-window and global layers (gemma3) gets a cache per kind of layer
    cfg = CacheConfig(**shape_fields(model.config), **opts, num_pages=num_pages, num_hot_pages=num_hot_pages,
                      device=param.device, dtype=param.dtype, layer_windows=layer_windows(model.config))
    manager = open_manager(cfg)
    if decision is not None:
        manager.events.emit(decision)  # recorded as the server's first record: the gate's decision
    return manager, name


def build(model, tokenizer, *, model_name: str, socket, ingest_token: str, policy: Path | None = None,
          codec: str | None = None, num_pages: int = 2048, max_seqs: int = 64, chunk: int = 256,
          max_model_len: int | None = None, default_user: str | None = None, max_body_bytes: int = 1 << 20,
          num_hot_pages: int | None = None, ignore_eos: bool = False, client_options: dict | None = None,
          fidelity: Path | None = None, split_pages: int | None = None, max_waiting: int | None = None,
          warmup: int = 0):
    """(app, engine, client): the engine started, the sidecar client started. num_hot_pages: the
    16-bit pool beside a codec's (default: as many pages as the codec's pool); warmup: prompt
    tokens of the start-up requests (Engine.warmup), 0 for none."""
    from ..client import SidecarClient
    from .app import create_app
    from .engine import Engine
    from .keys import KeyChecker

    manager, name = cache_manager(model, policy=policy, codec=codec, num_pages=num_pages,
                                  num_hot_pages=num_hot_pages, fidelity=fidelity, split_pages=split_pages)
    client = SidecarClient(manager, token=ingest_token, socket=socket, on_full="refuse",
                           **(client_options or {})).start()
    engine = Engine(model, tokenizer, manager, client=client, chunk=chunk, max_seqs=max_seqs,
                    max_model_len=max_model_len, ignore_eos=ignore_eos, policy_name=name,
                    max_waiting=max_waiting)
    if warmup:
        seconds = engine.warmup(warmup)
        print(f"kvguard serve-llm: warmed up in {seconds:.1f} s ({max_seqs} requests of {warmup} tokens)",
              file=sys.stderr)
    engine.start()
    keys = KeyChecker(token=ingest_token, socket=socket)
    app = create_app(engine, keys, model_name=model_name, policy_name=name, default_user=default_user,
                     max_body_bytes=max_body_bytes, client=client)
    return app, engine, client


def build_upstream(upstream: str, *, model_name: str, socket, ingest_token: str, upstream_model: str | None = None,
                   scope: str = "tenant", default_user: str | None = None, max_body_bytes: int = 1 << 20,
                   client_options: dict | None = None):
    """(app, client): the front before a vLLM server, its sidecar client started."""
    import httpx

    from ..client import SidecarClient
    from .keys import KeyChecker
    from .upstream import FrontProcess, Inflight, Salts, create_upstream_app

    inflight = Inflight()
    salts = Salts(httpx.AsyncClient(base_url="http://sidecar", transport=httpx.AsyncHTTPTransport(uds=str(socket)),
                                    timeout=10.0, headers={"Authorization": f"Bearer {ingest_token}"}))
    client = SidecarClient(FrontProcess(inflight, salts), token=ingest_token, socket=socket, on_full="refuse",
                           client_id="front", **(client_options or {})).start()
    keys = KeyChecker(token=ingest_token, socket=socket)
    app = create_upstream_app(upstream, keys, salts, inflight, model_name=model_name,
                              upstream_model=upstream_model or model_name, scope=scope, default_user=default_user,
                              max_body_bytes=max_body_bytes, client=client)
    return app, client


def max_requests(max_seqs: int) -> int:
    """Requests in flight (streams included) past which the answer is 503 with Retry-After:
    room for every running and waiting request (--max-waiting's default), those refused with
    429, and the probes."""
    return max_seqs * 4 + 16


def server_config(app, *, host: str = "127.0.0.1", port: int = 8000, max_seqs: int = 64,
                  read_timeout_s: float = 10.0, max_idle_connections: int = 512, **options):
    """uvicorn's settings for serve-llm: a read deadline on every request (408), idle and
    half-sent connections bounded apart from requests in flight (kvguard/connections.py), no
    `server` header. uvicorn's own `limit_concurrency` is not used: it counts idle sockets."""
    import uvicorn

    from ..connections import MAX_HEADER_BYTES, protocol

    http = protocol(read_timeout_s, max_waiting=max_idle_connections, max_requests=max_requests(max_seqs))
    return uvicorn.Config(app, host=host, port=port, http=http, server_header=False, timeout_keep_alive=5,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **{"log_level": "warning", **options})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..errors import ConfigError
    from ..threads import on_a_thread

    token = (args.ingest_token_file.read_text().strip() if args.ingest_token_file
             else os.environ.get("KVGUARD_INGEST_TOKEN", ""))
    if not token:
        raise ConfigError("no ingest token: set KVGUARD_INGEST_TOKEN or pass --ingest-token-file (create one with "
                          "'kvguard token create --scope ingest')")
    socket = args.socket or Path(os.environ.get("KVGUARD_SOCKET", "./.data/ingest.sock"))
    if not socket.exists():
        raise ConfigError(f"no sidecar socket at {socket}: start 'kvguard serve' first, or pass --socket")
    for name in ("num_pages", "max_seqs", "chunk", "max_body_bytes", "split_pages", "max_idle_connections",
                 "max_waiting"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer")
    if not 0 < args.read_timeout < float("inf"):
        raise ConfigError("--read-timeout must be a positive number of seconds")
    if (args.model is None) == (args.upstream is None):
        raise ConfigError("give --model (kvguard's engine) or --upstream URL (a vLLM server), one of them")
    if args.upstream is not None:
        if not args.upstream.startswith(("http://", "https://")):
            raise ConfigError("--upstream is the vLLM server's http:// or https:// address")
        name = args.served_model_name or args.upstream_model
        if not name:
            raise ConfigError("with --upstream, name the model: --served-model-name (and --upstream-model if "
                              "vLLM serves it under another name)")
        app, client = build_upstream(args.upstream, model_name=name, socket=socket, ingest_token=token,
                                     upstream_model=args.upstream_model, scope=args.prefix_sharing,
                                     default_user=args.default_user, max_body_bytes=args.max_body_bytes)
        try:  # the same deadlines and connection bounds as before kvguard's engine
            uvicorn.Server(server_config(app, host=args.host, port=args.port, max_seqs=args.max_seqs,
                                         read_timeout_s=args.read_timeout,
                                         max_idle_connections=args.max_idle_connections)).run()
        finally:
            client.close()
        return 0
    def start():
        print(f"kvguard serve-llm: loading {args.model} ...", file=sys.stderr)
        model, tok, model_name = load(args.model, args.device, args.dtype, rows=args.max_seqs)
        return build(model, tok, model_name=args.served_model_name or model_name, socket=socket, ingest_token=token,
                     policy=args.policy, codec=args.codec, num_pages=args.num_pages, fidelity=args.fidelity,
                     max_seqs=args.max_seqs, chunk=args.chunk, max_model_len=args.max_model_len,
                     default_user=args.default_user, max_body_bytes=args.max_body_bytes,
                     split_pages=args.split_pages, max_waiting=args.max_waiting, warmup=args.warmup)

    app, engine, client = on_a_thread(start, "kvguard-load")  # its OpenMP threads end with it (threads.py)
    try:
        uvicorn.Server(server_config(app, host=args.host, port=args.port, max_seqs=args.max_seqs,
                                     read_timeout_s=args.read_timeout,
                                     max_idle_connections=args.max_idle_connections)).run()
    finally:
        engine.stop()
        client.close()
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve-llm", help="serve a model over an OpenAI-compatible API, its KV cache kvguard's",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
