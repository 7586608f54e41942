"""The harness's knobs; imports nothing heavy, so the command line's help is quick."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# the least each knob can be: one scored token is predicted from the prefix alone, so a
# deviation needs a second one (with one, no query is compared and every deviation reads 0)
LEAST = {"prefix": 1, "score": 2, "chunk": 1, "generate": 0, "budget": 1, "page_size": 1}


@dataclass(frozen=True)
class Settings:
    prefix: int = 1024  # tokens written before scoring
    score: int = 1024  # tokens scored
    chunk: int = 16  # scored tokens per forward pass (one page: decode-like)
    generate: int = 32  # greedy tokens after the scored text
    budget: int = 256  # tokens kept by evictors / read by sparse
    page_size: int = 16
    dtype: str = "float16"  # the cache's dtype; the model runs in its own
    probe: ProbeSettings | None = None  # the retrieval probe (needle.py), when it ran

    def __post_init__(self) -> None:
        if isinstance(self.probe, dict):  # read back from a report's JSON
            object.__setattr__(self, "probe", ProbeSettings(**self.probe))
        for name, least in LEAST.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")


@dataclass(frozen=True)
class ProbeSettings:
    """The retrieval probe's knobs (kvguard/eval/needle.py)."""

    length: int = 1024  # tokens of the whole prompt: chat template, haystack, needle and question
    depths: tuple[int, ...] = (0, 25, 50, 75, 100)  # percent of the haystack before the needle
    seeds: int = 3  # each draws its own key and its own stretch of the text
    chunk: int = 64  # context tokens per forward pass after the first `budget`
    answer_tokens: int = 8  # greedy tokens generated (a key is a space and 5 digit tokens)
    text: str = ""  # the filler text's name

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(self.depths))
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 128:
            raise ConfigError(f"--probe-length must be an integer >= 128 tokens, got {self.length!r}")
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 100
                                  for d in self.depths):
            raise ConfigError(f"--probe-depths must be whole percentages from 0 to 100, got {list(self.depths)}")
        for name in ("seeds", "chunk", "answer_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--probe-{name.replace('_', '-')} must be an integer >= 1, got {v!r}")

    def describe(self) -> str:
        return (f"retrieval probe: a 5-digit pass key at depths {', '.join(f'{d} %' for d in self.depths)} of "
                f"{self.text or 'a text'}, {self.length}-token prompts (chat template), {self.seeds} seed(s) per "
                f"depth, greedy answer of {self.answer_tokens} tokens; the context fed in chunks of {self.chunk} "
                "tokens after the first budget's (-prefix methods: one pass, compressed once)")
