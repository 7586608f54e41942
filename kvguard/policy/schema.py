"""The policy schema: one YAML file per serving scenario (policies/*.yaml).

A policy chooses the compression layers (codec with its 16-bit sinks and window,
evictor and budget, the K/V split of cold values to CPU memory), the tiers a sequence may be offloaded to, the prefix-sharing
scope, the retention of subject data, and the fidelity bound the choice must
keep. `load_policy` validates a file and names file, line and field on every
error.

This module imports neither torch nor the cache, so the sidecar reads a policy's
retention without them: the codec and evictor options are checked here as the
cache's classes check them (tests/test_policy.py holds the two to the same
answers). Putting a policy to work on a cache is policy.runtime's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..cache.config import CacheConfig

SCENARIOS = ("chat", "long-document", "code", "rag", "reasoning", "offline-batch")
NO_H2O = ("rag", "reasoning")  # the seeds' matrix: evicting by past attention breaks retrieval and chains of thought
TIERS = ("device", "cpu", "disk", "redis")
LAYER_FACTOR = 3  # default bound on the worst layer, in multiples of the bound on the mean
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model, all a policy needs to size a cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_query_heads: int

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        from ..hf.cache import shape_fields

        return cls(**shape_fields(config))

    def as_config_fields(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "num_query_heads": self.num_query_heads}


class PolicyError(ConfigError):
    """A policy file is invalid: the message names file, line and field."""


# --- schema -------------------------------------------------------------------------------------

Count = Annotated[int, Field(ge=0, strict=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# The options each codec takes, with the check its class makes (kvguard/compress/codecs).
DEFAULT_INT4_GROUP = 32  # kvguard.kernels.quantize.INT4_GROUP (this module imports no torch; a test holds them equal)
_ROTATE = (lambda v: isinstance(v, bool), "rotate must be true or false")
CODEC_OPTIONS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "fp16": {"rotate": (lambda v: v is False, "16-bit pages do not rotate (rotate: false)")},
    "int8": {"rotate": _ROTATE}, "fp8": {"rotate": _ROTATE},
    "int4": {"group": (_positive_int, "group must be a positive integer"), "rotate": _ROTATE},
}


class Codec(_Strict):
    name: Literal["fp16", "int8", "int4", "fp8"]
    fp_sink: Count = 0  # first tokens kept 16-bit (whole pages)
    fp_window: Count = 0  # last tokens kept 16-bit (whole pages)
    options: dict = Field(default_factory=dict)  # e.g. int4's value group size: {group: 32}

    @model_validator(mode="after")
    def _options(self):
        # on load rather than when a cache is made, in the words make_codec would use
        takes = CODEC_OPTIONS[self.name]
        for key, value in self.options.items():
            if key not in takes:
                raise ValueError(f"bad options for codec {self.name!r}: it takes "
                                 f"{', '.join(sorted(takes)) or 'no options'}, not {key!r}")
            ok, rule = takes[key]
            if not ok(value):
                raise ValueError(f"bad options for codec {self.name!r}: {self.name}: {rule}, got {value!r}")
        return self


class Evictor(_Strict):
    name: Literal["streamingllm", "h2o", "snapkv"]
    budget: Annotated[int, Field(gt=0, strict=True)]
    sink: Count = 4
    window: Count = 64  # streamingllm: ignored, the window is budget - sink
    observe: Annotated[int, Field(gt=0, strict=True)] | None = None  # snapkv only
    pool: Annotated[int, Field(gt=0, strict=True)] | None = None  # snapkv only
    per_head: Annotated[bool, Field(strict=True)] = True  # h2o, snapkv: a keep set per layer and KV head (false: one for all)
    # h2o, snapkv: score by attention mass, or by mass × the value's L1 norm
    scoring: Literal["mass", "value_aware"] = "mass"
    # how the budget is split over layers and heads; the cache stores only "uniform" (checked below)
    allocation: Literal["uniform", "pyramid", "adaptive", "pyramid-adaptive", "global"] = "uniform"
    # h2o, snapkv: drop each head's whole pages first (a compaction then requantizes nothing)
    granularity: Literal["token", "page"] = "token"

    @model_validator(mode="after")
    def _fits(self):
        if self.name == "streamingllm" and self.budget <= self.sink:
            raise ValueError(f"budget {self.budget} leaves no room for a window after sink {self.sink}")
        if self.name != "streamingllm" and self.budget < self.sink + self.window:
            raise ValueError(f"budget {self.budget} is smaller than sink {self.sink} + window {self.window}")
        if self.name != "snapkv" and (self.observe is not None or self.pool is not None):
            raise ValueError("observe and pool are snapkv's options")
        if self.name == "streamingllm" and not self.per_head:
            raise ValueError("per_head is h2o's and snapkv's option (streamingllm keeps one set)")
        if self.name == "snapkv" and self.pool is not None and self.pool % 2 == 0:  # as SnapKV checks it
            raise ValueError("snapkv: observe must be >= 1 and pool an odd number >= 1")
        if self.name == "streamingllm" and self.scoring != "mass":
            raise ValueError("scoring is h2o's and snapkv's option (streamingllm keeps sinks and window)")
        if self.granularity != "token" and (self.name == "streamingllm" or not self.per_head):
            raise ValueError("granularity page is h2o's and snapkv's option, per head")
        if self.allocation != "uniform":  # as CacheManager refuses it
            raise ValueError(f"allocation {self.allocation} is not stored by the cache: a page holds every layer "
                             "and KV head, so all keep the same count; use allocation: uniform (kvguard eval "
                             "measures the others by read-time simulation)")
        return self

    def options(self) -> dict:
        if self.name == "streamingllm":  # its window is whatever the sinks leave of the budget
            return {"budget": self.budget, "sink": self.sink, "window": self.budget - self.sink}
        extra = {k: v for k, v in (("observe", self.observe), ("pool", self.pool)) if v is not None}
        if self.scoring != "mass":
            extra["scoring"] = self.scoring
        if self.granularity != "token":
            extra["granularity"] = self.granularity
        return {"budget": self.budget, "sink": self.sink, "window": self.window, "per_head": self.per_head} | extra


RULES = ("top_k", "fraction", "mass", "coverage")  # which cold pages a K/V split read fetches


class KvSplit(_Strict):
    """The K/V split tier (kvguard/cache/split.py): keys stay on the device, the values of pages
    older than the last `window` tokens live in CPU memory, and each read fetches the values of
    the cold pages that its attention mass picks: the `top_k` pages, a `fraction` of the cold
    pages, every page holding at least `mass` of some query head's attention, or the fewest
    pages holding `coverage` of every query head's attention (a bound on what a read leaves out
    that does not grow with the context); `mass` or `coverage` with `top_k` or `fraction`: those
    pages, at most that many (a bound on a step's reads); each query
    its own; `normalize`: a query's softmax over the keys whose values it read ("read")
    or over every key ("all": the pages not read keep their weight and add no value); `keys`: the
    codec of the split pages' keys (default the policy's; int4 beside int8 values: a longer
    context in the same device memory); `slots`: device page slots a layer that keep the pages
    read last, so that a page picked again is not read over the bus again (on the kernel path;
    at least twice the pages a step's rows pick, else a step reads in place); `host_keys` (with
    `keys`): the policy's keys kept in host memory too, so the smaller keys only pick the pages
    and a query attends over those it read with the policy's keys (twice the bytes over the bus
    a page read, the error of the policy's keys)."""

    enabled: Annotated[bool, Field(strict=True)] = True
    window: Count = 256  # tokens whose values stay on the device
    top_k: Annotated[int, Field(gt=0, strict=True)] | None = None
    fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    mass: Annotated[float, Field(gt=0, lt=1)] | None = None
    coverage: Annotated[float, Field(gt=0, lt=1)] | None = None
    normalize: Literal["read", "all"] = "read"
    keys: Literal["int8", "fp8", "int4"] | None = None
    slots: Annotated[int, Field(ge=2, strict=True)] | None = None
    host_keys: Annotated[bool, Field(strict=True)] = False

    @model_validator(mode="after")
    def _one_rule(self):
        given = [n for n in RULES if getattr(self, n) is not None]
        if not given or (self.top_k is not None and self.fraction is not None) or (
                self.mass is not None and self.coverage is not None):
            raise ValueError(f"give one of top_k, fraction, mass and coverage (which cold pages a read fetches), or "
                             f"mass or coverage with top_k or fraction as its cap; got {', '.join(given) or 'none'}")
        if self.host_keys and (self.keys is None or self.normalize != "read"):
            raise ValueError("host_keys needs keys (a smaller codec for the device) and normalize read")
        return self

    def options(self) -> dict:
        rule = {n: getattr(self, n) for n in RULES if getattr(self, n) is not None}
        return ({"window": self.window} | rule | ({"normalize": self.normalize} if self.normalize != "read" else {})
                | ({"keys": self.keys} if self.keys else {}) | ({"slots": self.slots} if self.slots else {})
                | ({"host_keys": True} if self.host_keys else {}))


def split_key(split: dict) -> str:
    """A K/V split as config_key names it: kvsplit@25%/w128, kvsplit@32p/w256, kvsplit@m0.01/w256,
    kvsplit@m0.01-64p/w256 (the mass rule capped at 64 pages), kvsplit@c0.99/w512 (coverage);
    `/all` when the pages not read keep their weight in the softmax (normalize: all), `/k-int4`
    when its keys are in their own codec (`/k-int4+host` with the cache's kept in host memory), `/slots64` when it keeps 64 pages a layer read last on
    the device, `/bound` (`/bound-r4`) when pages are ranked by Quest's
    bound (then by exact scores among 4 x k of them; a measurement, not a policy's)."""
    if split.get("top_k") is not None:
        rule = f"{split['top_k']}p"
    elif split.get("fraction") is not None:
        rule = f"{split['fraction'] * 100:g}%"
    else:
        rule = ""
    if split.get("mass") is not None:
        rule = f"m{split['mass']:g}" + (f"-{rule}" if rule else "")
    elif split.get("coverage") is not None:
        rule = f"c{split['coverage']:g}" + (f"-{rule}" if rule else "")
    norm = "/all" if split.get("normalize") == "all" else ""
    keys = f"/k-{split['keys']}{'+host' if split.get('host_keys') else ''}" if split.get("keys") else ""
    bound = "" if split.get("score", "exact") == "exact" else "/bound"
    bound += f"-r{split['rerank']}" if split.get("rerank") else ""
    slots = f"/slots{split['slots']}" if split.get("slots") else ""
    return f"kvsplit@{rule}/w{split.get('window', 256)}{norm}{keys}{slots}{bound}"


def config_key(options: dict) -> str:
    """A short name of a configuration given as CacheConfig options: int8(sink 4)+h2o@1024/s4/w256
    (evictor budget, sinks, recent window; `/shared` when H2O or SnapKV keep one set for all
    layers and heads instead of one per layer and KV head; `/value` when they score by mass ×
    the value's norm; `/pyramid`, `/adaptive`, `/pyramid-adaptive`, `/global` for an unequal allocation;
    `/pages` when each head's whole pages are dropped first),
    then the K/V split when there is one (`+kvsplit@25%/w128`)."""
    extra = ", ".join(f"{n} {options[f]}" for n, f in (("sink", "fp_sink"), ("window", "fp_window"))
                      if options.get(f))
    name = options.get("codec") or "fp16"
    opts = options.get("codec_options") or {}
    if opts.get("rotate"):
        name += "+rot"  # stored rotated (kvguard/compress/codecs/rotation.py)
    if opts.get("group") not in (None, DEFAULT_INT4_GROUP):
        name += f"/g{opts['group']}"
    name += f"({extra})" if extra else ""
    evictor = options.get("evictor")
    split = "+" + split_key(options["kv_split"]) if options.get("kv_split") else ""
    if not evictor:
        return name + split
    e = options["evictor_options"]
    shape = f"/s{e.get('sink', 4)}" + ("" if evictor == "streamingllm" else f"/w{e.get('window', 64)}")
    if evictor != "streamingllm" and not e.get("per_head", True):
        shape += "/shared"  # one keep set for all layers and heads
    if e.get("scoring", "mass") != "mass":
        shape += "/value"
    if e.get("allocation", "uniform") != "uniform":
        shape += f"/{e['allocation']}"
    if e.get("granularity", "token") != "token":
        shape += "/pages"  # whole pages of a head dropped first
    return f"{name}+{evictor}@{e['budget']}{shape}{split}"


class Layers(_Strict):
    """One configuration of the compression layers: what a downgrade step replaces."""

    codec: Codec
    evictor: Evictor | None = None
    kv_split: KvSplit | None = None

    @property
    def key(self) -> str:
        return config_key(self.cache_options())

    def cache_options(self) -> dict:
        e, split = self.evictor, self.kv_split
        return {"codec": self.codec.name, "codec_options": dict(self.codec.options), "fp_sink": self.codec.fp_sink,
                "fp_window": self.codec.fp_window, "evictor": e.name if e else None,
                "evictor_options": e.options() if e else {},
                "kv_split": split.options() if split and split.enabled else None}


class Retention(_Strict):
    max_age: str  # "30d", "12h", "90m", "3600s", "2w"

    @field_validator("max_age")
    @classmethod
    def _duration(cls, v: str) -> str:
        if not re.fullmatch(r"[1-9][0-9]*[smhdw]", v):
            raise ValueError(f"max_age must be a positive duration like 30d, 12h, 90m, 3600s or 2w, got {v!r}")
        return v

    @property
    def seconds(self) -> int:
        return int(self.max_age[:-1]) * UNITS[self.max_age[-1]]


class Fidelity(_Strict):
    """The bound a configuration must keep (docs/fidelity.md#gate), each on the worst text. The
    first two are the original keys; the others are optional, so older policy files load."""

    max_attention_deviation: Annotated[float, Field(gt=0, lt=1)] = 0.01  # mean over layers
    max_ppl_increase: Annotated[float, Field(gt=0)] = 0.5  # ΔPPL
    # the worst single layer; default LAYER_FACTOR x max_attention_deviation: 3 % at 1 %, between
    # INT8's worst layer (1.33 %) and the next codecs' (FP8 5.6 %, INT4 5.9 %) on SmolLM2-135M
    max_layer_deviation: Annotated[float, Field(gt=0, lt=1)] = 0.03
    max_ppl_increase_rel: Annotated[float, Field(gt=0)] | None = None  # ΔPPL / PPL of the 16-bit cache

    @model_validator(mode="before")
    @classmethod
    def _default_layer_bound(cls, data):
        if isinstance(data, dict) and data.get("max_layer_deviation") is None:
            data = {k: v for k, v in data.items() if k != "max_layer_deviation"}
            mean = data.get("max_attention_deviation", 0.01)
            if isinstance(mean, int | float) and not isinstance(mean, bool) and 0 < mean < 1:
                data["max_layer_deviation"] = round(min(LAYER_FACTOR * mean, 0.999), 6)
        return data

    @model_validator(mode="after")
    def _layer_over_mean(self):
        if self.max_layer_deviation < self.max_attention_deviation:
            raise ValueError(f"max_layer_deviation {self.max_layer_deviation} is below max_attention_deviation "
                             f"{self.max_attention_deviation}: the worst layer is never under the mean")
        return self


class Policy(Layers):
    name: str
    scenario: Literal[SCENARIOS]
    description: str = ""
    page_size: Annotated[int, Field(gt=0, strict=True)] = 16
    tiers: list[Literal[TIERS]] = Field(default_factory=lambda: ["device"])
    prefix_sharing: Literal["none", "tenant"] = "none"
    retention: Retention
    fidelity: Fidelity = Field(default_factory=Fidelity)
    on_violation: Literal["refuse", "downgrade"]
    downgrade: list[Layers] = Field(default_factory=list)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list[str]) -> list[str]:
        if not v or v[0] != "device" or len(set(v)) != len(v):
            raise ValueError(f"tiers must start with device and name each tier once, fastest first, got {v}")
        return v

    def steps(self) -> list[Layers]:
        """The configuration as written, then each downgrade step in order."""
        return [Layers(codec=self.codec, evictor=self.evictor, kv_split=self.kv_split), *self.downgrade]

    def at(self, step: int) -> Policy:
        """This policy with step `step` of `steps()` as its compression layers."""
        steps = self.steps()
        if step < 0:  # PolicyDecision.step of a refusal: no configuration may run
            raise ConfigError(f"policy {self.name!r} was refused: no configuration of it is in force; "
                              "measure a safer configuration or raise its fidelity bound")
        if step >= len(steps):
            raise ConfigError(f"policy {self.name!r} has steps 0 to {len(steps) - 1}, not {step}")
        layers = steps[step]
        return self.model_copy(update={"codec": layers.codec, "evictor": layers.evictor, "kv_split": layers.kv_split})

    def cache_options(self) -> dict:
        return super().cache_options() | {"page_size": self.page_size, "tiers": tuple(self.tiers),
                                          "prefix_sharing": self.prefix_sharing == "tenant"}

    def cache_config(self, shape: ModelShape, **overrides) -> CacheConfig:
        """A CacheConfig for a model of this shape (overrides: dtype, device, num_pages, ...).
        Imports the cache's config (torch), as the rest of the schema never does."""
        from ..cache.config import CacheConfig

        return CacheConfig(**shape.as_config_fields(), **(self.cache_options() | overrides))


# --- loading ------------------------------------------------------------------------------------


def _lines(node: yaml.Node, path: tuple = (), out: dict | None = None,
           twice: list | None = None) -> dict[tuple, int]:
    """Line (1-based) of every mapping key and sequence item in a composed YAML tree; `twice`
    gets (line, path) of each key given again in its mapping (PyYAML keeps the last silently)."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key, line = (*path, k.value), k.start_mark.line + 1
            if key in out and twice is not None:
                twice.append((line, key))
            out[key] = line
            _lines(v, key, out, twice)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, (*path, i), out, twice)
    return out


def _where(lines: dict[tuple, int], loc: tuple) -> tuple[int, str]:
    loc = tuple(p for p in loc if not (isinstance(p, str) and p in ("function-after", "literal")))
    field = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[") or "(top level)"
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1), field


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Validate a policy's YAML text; errors name source, line and field."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else 1
        raise PolicyError(f"{source}:{line}: not valid YAML: {e.problem}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{source}:1: a policy is a mapping of fields (name, scenario, codec, ...)")
    twice: list[tuple[int, tuple]] = []
    lines = _lines(node, twice=twice)
    if twice:
        line, key = twice[0]
        raise PolicyError(f"{source}:{line}: {_where(lines, key)[1]}: given twice; keep one "
                          "(YAML would silently use the last)")
    try:
        policy = Policy.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            line, field = _where(lines, err["loc"])
            msgs.append(f"{source}:{line}: {field}: {err['msg'].removeprefix('Value error, ')}")
        raise PolicyError("\n".join(msgs)) from None
    _check_rules(policy, lines, source)
    return policy


def _check_rules(policy: Policy, lines: dict[tuple, int], source: str) -> None:
    """Rules across fields, each reported at the field that breaks it."""
    def fail(loc: tuple, msg: str):
        line, field = _where(lines, loc)
        raise PolicyError(f"{source}:{line}: {field}: {msg}")

    if policy.on_violation == "downgrade" and not policy.downgrade:
        fail(("on_violation",), "downgrade needs a non-empty downgrade list of safer configurations")
    for i, step in enumerate(policy.steps()):
        if policy.scenario in NO_H2O and step.evictor and step.evictor.name == "h2o":
            fail(("evictor", "name") if i == 0 else ("downgrade", i - 1, "evictor", "name"),
                 f"the {policy.scenario} scenario never uses h2o (it drops context that later questions "
                 "or reasoning steps need); use streamingllm or no evictor")
        if step.kv_split and step.kv_split.enabled and "cpu" not in policy.tiers:
            fail(("kv_split",) if i == 0 else ("downgrade", i - 1, "kv_split"),
                 "the K/V split keeps cold values in CPU memory: add cpu to tiers, or disable it")


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(f"{p}: cannot read the policy: {e.strerror}") from None
    return parse_policy(text, str(p))


def load_policies(folder: str | Path) -> dict[str, Policy]:
    """Every *.yaml policy in a folder, by policy name."""
    out: dict[str, Policy] = {}
    for p in sorted(Path(folder).glob("*.yaml")):
        policy = load_policy(p)
        if policy.name in out:
            raise PolicyError(f"{p}:1: name: {policy.name!r} is already the name of another policy in {folder}")
        out[policy.name] = policy
    return out


# --- measurement (calibrated in policy.runtime) ------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """Fidelity measured for one configuration (see docs/fidelity.md for the protocol), each
    number on the worst text. Greedy agreement is not among them: one flipped token changes
    every later one, so it is reported, never gated on."""

    mean_layer_deviation: float  # attention-output relative deviation, mean over layers
    ppl_delta: float  # perplexity change against the uncompressed cache
    worst_layer_deviation: float | None = None  # the largest single layer's; None: not measured
    ppl_increase_rel: float | None = None  # ppl_delta / the uncompressed cache's perplexity
    evictor_fired: bool | None = None  # False: the configuration's evictor dropped nothing while scoring

    def exceeded(self, bound: Fidelity) -> list[str]:
        """The bounds this measurement does not keep (empty: within all of them)."""
        over = []
        if not self.mean_layer_deviation < bound.max_attention_deviation:
            over.append("max_attention_deviation")
        if not self.ppl_delta < bound.max_ppl_increase:
            over.append("max_ppl_increase")
        if self.worst_layer_deviation is not None and not self.worst_layer_deviation < bound.max_layer_deviation:
            over.append("max_layer_deviation")
        if (bound.max_ppl_increase_rel is not None and self.ppl_increase_rel is not None
                and not self.ppl_increase_rel < bound.max_ppl_increase_rel):
            over.append("max_ppl_increase_rel")
        return over

    def within(self, bound: Fidelity) -> bool:
        """Within every bound, and the evictor (if any) measured: an evictor that never fired
        was not measured, and does not pass."""
        return not self.exceeded(bound) and self.evictor_fired is not False
