"""OpenAI's request bodies for chat completions and completions: the models, their parsing and
validation.

Pure (no Ray, no FastAPI, no engine): a request body in, a typed request or an `ApiError`
(errors.py) out. The endpoint must look like OpenAI's to an OpenAI client, so fields, limits
and error messages follow the public API reference; the response bodies are in responses.py.

Parameters this server knows but cannot honour are rejected by name (400) unless sent at
their neutral value, never silently ignored: a client asking for best_of=2 or tools would
otherwise get a confidently wrong answer. Parameters it does not know at all are ignored and
named in the `x-tokenmill-warning` response header (as vLLM ignores them with a logged
warning), so a newer client that sends a new field keeps working; strict mode
(`x-tokenmill-strict: 1` or the serve file's `http.strict_fields`) turns them back into 400s.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from engines.api import MAX_LOGPROBS, MAX_SAMPLES
from pipeline.openai import params
from pipeline.openai.errors import ApiError
from pipeline.openai.tools import ToolError, ToolPlan, read_tools
from pipeline.spec.sampling import MAX_TEMPERATURE, TOP_P_RANGE

WARNING_HEADER = "x-tokenmill-warning"  # what the server ignored or changed in a request
STRICT_HEADER = "x-tokenmill-strict"  # "1": unknown request fields are a 400, not a warning

# The parameters Serve shares with batch input lines (supported sampling ones, and those refused
# unless "off") are in one table: params.py.

# Names apply_chat_template (or the template itself) already uses: a chat_template_kwargs key
# among them would replace the conversation, the template or the tokenization, not add a variable.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# The shared table's refused fields that chat requests take (pipeline.openai.tools).
CHAT_TOOL_FIELDS = ("tools", "tool_choice")
MAX_NAMED_FIELDS = 16  # ignored fields named in the warning header; the rest are counted


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    # None: not sent (OpenAI's default applies: pipeline.openai.sampling.resolve).
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices to generate for the prompt; the engine computes the prompt once for all.
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    # Accepted with any value and unused: bookkeeping fields that do not change the answer.
    user: str | None = None
    parallel_tool_calls: bool | None = None  # chat with tools: whether calls may be several
    store: bool | None = None  # nothing is stored here either way
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic
    # Extensions (vLLM spells them the same way). top_k -1 is vLLM's "off", like 0.
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # OpenAI's response_format (text, json_object, json_schema) and tokenmill's regex and
    # choice in the same style; read by pipeline.openai.response_format, enforced by the engine.
    response_format: dict[str, Any] | None = None

    _ignored: tuple[str, ...] = PrivateAttr(default=())
    # SamplingParams values of the shared table's parameters (penalties, min_p, logit_bias...).
    _sampling: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Unknown fields the request carried, dropped before validation (not strict mode)."""
        return self._ignored

    @property
    def sampling_values(self) -> dict[str, Any]:
        """SamplingParams keyword values read by pipeline.openai.params (shared with batch)."""
        return dict(self._sampling)

    @property
    def top_k_value(self) -> int:
        return self.top_k if self.top_k and self.top_k > 0 else 0

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str  # data:image/...;base64,... always; http(s) only to configured hosts
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    refusal: str | None = None
    # An assistant turn's calls ({id, type, function: {name, arguments}}), and a tool turn's
    # answer to one of them (pipeline.openai.tools checks that it answers an earlier call).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (pipeline.openai.chat.chat_messages)."""
        content: Any = self.text
        if isinstance(self.content, list) and any(p.type == "image_url" for p in self.content):
            content = [p.model_dump(exclude_none=True) for p in self.content]  # parts, in order
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM extension: extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template (GPT-OSS's `Reasoning: low|medium|high`).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Read by pipeline.openai.tools (read_tools: their shapes and JSON Schemas, 400s by field).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None

    _tools: ToolPlan | None = PrivateAttr(default=None)

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The request's tools, read and checked (None: none)."""
        return self._tools

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report (chat: logprobs true, top_logprobs k); None: off."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(
                400,
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_value",
            )
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        """The name the client used, so a clamp or error message quotes it back."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt before the completion in each choice's text; with logprobs, the prompt's
    # tokens' logprobs first (scoring, as lm-eval's loglikelihood requests use it).
    echo: bool = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 telling the client what is wrong with it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(
            400,
            f"We could not parse the JSON body of your request ({exc}). Send a JSON object "
            "with Content-Type: application/json.",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise ApiError(
            400,
            f"The request body must be a JSON object, got {type(data).__name__}.",
            code="invalid_json",
        )
    return data


def _shared_params(data: dict[str, Any]) -> dict[str, Any]:
    """Check and remove the shared table's parameters from `data` (the caller's copy): refused
    ones unless "off", supported ones read into SamplingParams values (returned)."""
    try:
        params.check_refused(data)
        values = params.sampling_values(data)
    except params.ParamError as exc:
        code = "unsupported_parameter" if exc.unsupported else "invalid_value"
        raise ApiError(400, str(exc), param=exc.name, code=code) from None
    for name in (*params.REFUSED, *params.SAMPLING):
        data.pop(name, None)
    return values


def strict_mode(header: str | None, default: bool) -> bool:
    """Whether unknown fields are refused: the request's STRICT_HEADER, else the serve file's
    http.strict_fields. An unreadable header is a 400 rather than a guess either way."""
    if header is None or not header.strip():
        return default
    value = header.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ApiError(
        400,
        f"Header {STRICT_HEADER} must be 1 or 0 (true/false), got {header[:40]!r}",
        code="invalid_value",
    )


def _pop_unknown(data: dict[str, Any], model: type[_Request]) -> list[str]:
    """Remove the fields neither the model nor the known-unsupported list knows; their names
    (nested ones as `stream_options.x`). `data` is the caller's own copy."""
    known = set(model.model_fields) | set(params.REFUSED) | set(params.SAMPLING)
    unknown = [name for name in data if name not in known]
    for name in unknown:
        del data[name]
    options = data.get("stream_options")
    if isinstance(options, dict):
        extra = [name for name in options if name not in StreamOptions.model_fields]
        if extra:
            data["stream_options"] = {k: v for k, v in options.items() if k not in extra}
            unknown += [f"stream_options.{name}" for name in extra]
    return unknown


def _unknown_error(names: list[str]) -> ApiError:
    return ApiError(
        400,
        f"Unrecognized request argument supplied: {', '.join(names)} (strict mode refuses "
        f"unknown fields; without it they are ignored with a {WARNING_HEADER} header)",
        param=names[0],
        code="unknown_parameter",
    )


def _header_safe(name: str) -> str:
    """A client-chosen field name made safe and short for a response header value."""
    return re.sub(r"[^A-Za-z0-9_.:/\[\]-]", "?", name)[:64]


def ignored_warning(names: tuple[str, ...]) -> str:
    """The warning header text naming ignored fields (at most MAX_NAMED_FIELDS of them)."""
    shown = ", ".join(_header_safe(n) for n in names[:MAX_NAMED_FIELDS])
    more = len(names) - MAX_NAMED_FIELDS
    return f"ignored unknown fields: {shown}" + (f" and {more} more" if more > 0 else "")


def _parse(data: dict[str, Any], model: type[RequestT], strict: bool) -> RequestT:
    data = dict(data)
    sampling = _shared_params(data)
    unknown = _pop_unknown(data, model)
    if unknown and strict:
        raise _unknown_error(unknown)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request._ignored = tuple(unknown)
    request._sampling = sampling
    _check_stop(request)
    return request


def _validation_error(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union types add the member's type name to the location; keep the field path only.
    loc = [p for p in loc if not p.startswith(("list[", "str", "int", "bool", "float"))]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    elif err["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
        code = "missing_required_parameter"
    else:
        value = json.dumps(err.get("input"), default=str)[:80]
        message = f"Invalid value for '{param}': {err['msg']} (got {value})."
        code = "invalid_value"
    return ApiError(400, message, param=param, code=code)


def parse_chat_request(data: dict[str, Any], *, strict: bool = False) -> ChatCompletionRequest:
    if data.get("echo") not in (None, False):
        raise ApiError(
            400,
            "'echo' is a /v1/completions parameter; chat completions do not repeat the prompt",
            param="echo",
            code="unsupported_parameter",
        )
    data = {k: v for k, v in data.items() if k != "echo"}
    # Chat takes tools (pipeline.openai.tools); the shared table refuses them elsewhere.
    tool_fields = {k: data.pop(k) for k in CHAT_TOOL_FIELDS if k in data}
    request = _parse(data, ChatCompletionRequest, strict)
    _check_template_kwargs(request.chat_template_kwargs)
    if tool_fields:
        request = request.model_copy(update=tool_fields)
    try:
        request._tools = read_tools(
            request.tools,
            request.tool_choice,
            request.parallel_tool_calls,
            [m.chat_dict() for m in request.messages],
        )
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    return request


def parse_completion_request(data: dict[str, Any], *, strict: bool = False) -> CompletionRequest:
    request = _parse(data, CompletionRequest, strict)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
        raise ApiError(
            400,
            f"'prompt' holds {len(prompt)} prompts; this server completes one prompt per request",
            param="prompt",
            code="unsupported_parameter",
        )
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
    return request


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(set(kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(
            400,
            f"'chat_template_kwargs' may not set {', '.join(reserved)}: the server sets those "
            "itself; pass only the template's own variables (e.g. enable_thinking)",
            param=f"chat_template_kwargs.{reserved[0]}",
            code="invalid_value",
        )


def _check_stop(request: _Request) -> None:
    stops = request.stop_list
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(
            400,
            "'stop' takes up to 4 non-empty strings",
            param="stop",
            code="invalid_value",
        )
