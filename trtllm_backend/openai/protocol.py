"""Request models of the OpenAI API subset the gateway serves, and their checks.

Policy: types are strict (no "5" for 5, no 1 for true), unknown fields are refused (vLLM's `min_tokens` and
`ignore_eos` extensions are known), and OpenAI fields the engine cannot honour (n > 1, logit_bias, suffix,
best_of > 1, tools and function calling, store: true) are refused by name as unsupported rather than ignored;
every refusal is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import OpenAIError, bad_param

MAX_STOP = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI; the completions' logprobs gets the same bound (OpenAI: 5)
# Fields of OpenAI's API this gateway knows and refuses as unsupported (by name, not as "unknown field").
UNSUPPORTED = {
    "tools": "tool calling is not supported by this model server",
    "tool_choice": "tool calling is not supported by this model server",
    "parallel_tool_calls": "tool calling is not supported by this model server",
    "functions": "function calling is not supported by this model server",
    "function_call": "function calling is not supported by this model server",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
UINT64_MAX = 2**64 - 1  # the Triton model's seed is UINT64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates expect it. NOTE: OpenAI's `developer` role is its newer name for
        `system`; templates of open models know only `system`."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text} | ({"name": self.name} if self.name else {})


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced: structured outputs are constrained decoding


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guide(self) -> tuple[str, str] | None:
        """(the Triton model's guided_decoding_guide_type, its guide), or None for free text."""
        if self.type == "json_object":
            return "json", ""
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise bad_param("response_format.json_schema.schema", "is required for type json_schema")
            return "json_schema", json.dumps(self.json_schema.schema_)
        return None


class GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted, not used
    store: bool | None = None  # OpenAI's "keep this completion": nothing is stored here, so only false/null
    metadata: dict[str, str] | None = None  # tags for stored completions: accepted, not used
    # vLLM's extensions, which its serving benchmark and genai-perf send to force output lengths.
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    # vLLM's request priority: lower is more important. Forwarded as the model's `priority` input, whose range the
    # engine checks (trtllm_backend.sampling; the error names the field).
    priority: int | None = None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        """What pydantic's field types cannot say."""
        if self.n not in (None, 1):
            raise bad_param("n", f"only n=1 is supported, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "is only allowed when stream is true")
        if self.logit_bias:
            raise bad_param("logit_bias", "is not supported")
        if self.store:
            raise bad_param("store", "is not supported: this server stores no completions (send false or omit it)")
        stops = self.stop_list
        if len(stops) > MAX_STOP:
            raise bad_param("stop", f"at most {MAX_STOP} sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise bad_param("stop", "sequences must not be empty")
        limit_field, limit = self.output_limit
        if self.ignore_eos and limit is None:
            raise bad_param("ignore_eos", f"needs {limit_field}: it generates until that limit")
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise bad_param("min_tokens", f"{self.min_tokens} is above {limit_field} ({limit})")
        if self.guide is not None and (self.ignore_eos or self.min_tokens):
            raise bad_param(
                "ignore_eos" if self.ignore_eos else "min_tokens",
                "cannot be combined with response_format (the schema decides where the output ends)",
            )

    @property
    def alternatives(self) -> int | None:
        """Log probs asked for: None, or how many alternatives per token."""
        return None

    @property
    def guide(self) -> tuple[str, str] | None:
        """Structured output asked for (response_format), as the Triton model's guide type and guide."""
        response_format = getattr(self, "response_format", None)
        return response_format.guide() if response_format is not None else None

    @property
    def min_output(self) -> int | None:
        """Tokens generated before an end-of-sequence may stop the request (ignore_eos: all of them)."""
        return self.output_limit[1] if self.ignore_eos else self.min_tokens

    @property
    def output_limit(self) -> tuple[str, int | None]:
        """(the field the client used for the output limit, its value)."""
        return "max_tokens", self.max_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_param("top_logprobs", "needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_param("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")

    @property
    def alternatives(self) -> int | None:
        """Log probs asked for: None, or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # vLLM's extension of the legacy endpoint
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise bad_param("prompt", f"one prompt per request is supported, got a list of {len(self.prompt)}")
        if not self.text:
            raise bad_param("prompt", "must not be empty")
        for name, unsupported in (("suffix", self.suffix is not None), ("best_of", self.best_of not in (None, 1))):
            if unsupported:
                raise bad_param(name, "is not supported")

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# pydantic adds the union member it tried to an error's location ("content", "str"); OpenAI names the field.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param_name(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or "body"


def parse(model: type[GenerationRequest], body: object) -> GenerationRequest:
    """A checked request, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", param="body", code="invalid_body")
    for name, why in UNSUPPORTED.items():
        if (
            body.get(name) is not None
        ):  # NOTE: frameworks send an empty tools list or tool_choice "none" by default: no request
            if body[name] not in ([], "none"):
                raise OpenAIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        # The deepest error is the most specific: for a union it is the branch that got furthest.
        first = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
        param = _param_name(first["loc"])
        detail = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise bad_param(param, detail) from None
    request.check()
    return request
