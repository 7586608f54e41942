"""The OpenAI request bodies this server takes, validated (422 for a field of the wrong kind).

Types are strict: a number sent as a string (`"max_tokens": "16"`), a boolean as a number or a
number as a boolean (`"temperature": true`) is refused, never coerced; so are NaN and infinite
numbers. Fields the server does not implement are refused when they ask for something other
than the default, rather than ignored: a client that asks for n=2 gets a 422 that says so.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TEXT = 1_000_000  # characters of one message or prompt (the body limit binds first)
Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00]+$")]


STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_TEXT)]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_TEXT)] | Annotated[list[TextPart], Field(max_length=64)]
    name: Id | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Common(BaseModel):
    model_config = STRICT
    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[str, Field(min_length=1, max_length=64)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Id | None = None
    # not implemented beyond their defaults (ranges, not Literal: a Literal takes true for 1)
    n: Annotated[int, Field(ge=1, le=1)] = 1
    presence_penalty: Annotated[float, Field(ge=0, le=0)] = 0
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] = 0

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Common):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            raise ValueError("give one prompt as a string; lists of prompts or of token ids are not served")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not served")
        return v

    def limit(self) -> int | None:
        return self.max_tokens
