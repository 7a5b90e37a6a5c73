"""From a parsed OpenAI request to an engine request, and from an engine result to `usage`.

Pure functions between the wire format (pipeline.openai) and the engine contract
(engines.api): tokenization through the model's tokenizer, the token caps (an oversize prompt is
a 400; a max_tokens over the server's cap or the context's room is clamped, with a warning),
OpenAI's defaults (temperature 1, max_tokens 16 on /v1/completions), and the cost of a result.
The ingress deployment calls these; keeping them out of it keeps them testable without Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engines.api import EngineInfo, GenerationRequest, GenerationResult, ImageInput
from pipeline.cost import cost_usd, list_price_usd
from pipeline.openai.errors import ApiError
from pipeline.openai.models import (
    WARNING_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_warning,
    parse_chat_request,
    parse_completion_request,
)
from pipeline.openai.responses import Endpoint, ResponseIds, Usage
from pipeline.openai.sampling import SamplingError, resolve
from pipeline.openai.tools import ToolParser, ToolPlan, call_schema
from pipeline.serve.protocol.tokens import PromptTokenizer
from pipeline.serve.spec import ServedModelSpec
from pipeline.spec.response_format import FormatError, parse_response_format

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to dispatch: endpoint, model, engine request, stream mode."""

    endpoint: Endpoint
    served: ServedModelSpec
    engine_request: GenerationRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    warnings: tuple[str, ...] = ()  # what was ignored or clamped, for the warning header
    n: int = 1  # choices to generate (samples of engine_request: engines.samples)
    echo: str | None = None  # completions with echo: the prompt text that opens every choice
    split_reasoning: bool = False  # chat on a model with prompt.reasoning: answers are split
    tools: ToolPlan | None = None  # chat with tools: how calls are made and read
    tool_parser: ToolParser | None = None  # how this model writes calls (tool_choice auto)
    ids: ResponseIds = field(init=False)

    def __post_init__(self) -> None:
        ids = ResponseIds.new(self.endpoint, self.engine_request.request_id, self.model)
        object.__setattr__(self, "ids", ids)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the request runs with (None: the served model itself)."""
        return self.engine_request.adapter

    @property
    def model(self) -> str:
        """The name the request gave and its response echoes: the adapter's, else the model's."""
        return self.adapter or self.served.name

    @property
    def headers(self) -> dict[str, str]:
        """Response headers that tell the client what the server did not do as asked."""
        return {WARNING_HEADER: "; ".join(self.warnings)} if self.warnings else {}


@dataclass(frozen=True)
class MaxTokens:
    """The max_tokens a request runs with, and the warning when that is less than it asked."""

    value: int
    warning: str | None = None


def parse_request(
    data: dict[str, Any], endpoint: Endpoint, *, strict: bool = False
) -> ChatCompletionRequest | CompletionRequest:
    if endpoint == "chat":
        return parse_chat_request(data, strict=strict)
    return parse_completion_request(data, strict=strict)


def has_image_parts(request: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the request is a chat with image parts (text-only part lists are text)."""
    return isinstance(request, ChatCompletionRequest) and any(
        isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
        for m in request.messages
    )


def read_images(
    request: ChatCompletionRequest, tokenizer: PromptTokenizer
) -> tuple[ImageInput, ...]:
    """A chat's images fetched, decoded and processed (to_engine_request's `images`)."""
    return tokenizer.chat_images([m.chat_dict() for m in request.messages])


def to_engine_request(
    request: ChatCompletionRequest | CompletionRequest,
    endpoint: Endpoint,
    served: ServedModelSpec,
    tokenizer: PromptTokenizer,
    info: EngineInfo,
    adapter: str | None = None,
    images: tuple[ImageInput, ...] | None = None,
) -> Prepared:
    """Tokenize, apply the caps and OpenAI's defaults; ApiError (400) names what to change.
    `adapter`: the LoRA adapter of `served` the request named (an adapter shares its base
    model's tokenizer and chat template). `images`: the chat's images as read_images read
    them (on other threads than the tokenizer's), or None to read them here."""
    echo: str | None = None
    if isinstance(request, ChatCompletionRequest):
        if not served.prompt.chat_template or not tokenizer.has_chat_template:
            raise ApiError(
                400,
                f"model '{served.name}' has no chat template; use /v1/completions",
                param="messages",
                code="unsupported_endpoint",
            )
        messages = [m.chat_dict() for m in request.messages]
        template_kwargs = chat_template_kwargs(request, served)
        plan = request.tool_plan
        if plan is not None and plan.template_tools is not None:
            template_kwargs = {**(template_kwargs or {}), "tools": plan.template_tools}
        if has_image_parts(request):
            # Images per request and bytes per image: the model's prompt.images limits.
            prompt_ids, images = tokenizer.chat_request(messages, template_kwargs, images)
        else:
            prompt_ids, images = tokenizer.chat_ids(messages, template_kwargs), ()
        prompt_param = "messages"
        default_max = served.limits.default_max_tokens
    else:
        prompt_ids, images = completion_prompt_ids(request, tokenizer), ()
        prompt_param = "prompt"
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
        if request.echo:
            echo = _prompt_text(request, tokenizer, prompt_ids)
    max_tokens = capped_max_tokens(
        served,
        info,
        len(prompt_ids),
        request.requested_max_tokens,
        default_max,
        prompt_param,
        param=request.max_tokens_param,
    )
    plan = request.tool_plan if isinstance(request, ChatCompletionRequest) else None
    asked_format = request.response_format
    if plan is not None and plan.constrained:
        if asked_format is not None and asked_format.get("type") != "text":
            raise ApiError(
                400,
                f"tool_choice {plan.forced or plan.mode!r} makes the answer a tool call; "
                "response_format cannot shape it too: send one of them",
                param="response_format",
                code="invalid_value",
            )
        asked_format = call_schema(plan)  # the call always parses (pipeline.openai.tools)
    elif (
        plan is not None
        and plan.mode == "auto"
        and tokenizer.tool_parser.name == "harmony"
        and served.prompt.reasoning != "harmony"
    ):  # GPT-OSS's calls are special-token messages only the harmony split reads
        raise ApiError(
            400,
            f"model {served.name!r} writes harmony tool calls, which only its harmony "
            "split reads: its config needs prompt.reasoning: harmony (or send "
            "tool_choice required or a named function)",
            param="tools",
            code="invalid_value",
        )
    try:
        response_format = parse_response_format(asked_format)
    except FormatError as exc:
        param = "tools" if plan is not None and plan.constrained else "response_format"
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    logprobs = request.requested_logprobs
    # Echo with logprobs scores the prompt too: its tokens' logprobs, as many alternatives.
    prompt_logprobs = logprobs if echo is not None else None
    if prompt_logprobs is not None and info.kind == "trtllm":
        raise ApiError(
            400,
            f"model '{served.name}' runs on TensorRT-LLM, which does not return the prompt's "
            "logprobs (echo with logprobs); send the request without one of them",
            param="echo",
            code="unsupported_parameter",
        )
    values = {
        "max_tokens": max_tokens.value,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k_value,
        "seed": request.seed,
        "stop": request.stop_list,
        "stop_token_ids": tuple(request.stop_token_ids or ()),
        "ignore_eos": request.ignore_eos,
        "response_format": response_format,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        **request.sampling_values,  # penalties, min_p, logit_bias... (pipeline.openai.params)
    }
    try:
        sampling = resolve(values)  # a served model configures no sampling defaults
    except SamplingError as exc:
        param = exc.field if exc.field in values else None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    warnings = []
    if request.ignored_fields:
        warnings.append(ignored_warning(request.ignored_fields))
    if max_tokens.warning:
        warnings.append(max_tokens.warning)
    return Prepared(
        endpoint,
        served,
        GenerationRequest(
            prompt_token_ids=prompt_ids, sampling=sampling, adapter=adapter, images=images
        ),
        stream=request.stream,
        include_usage=request.include_usage,
        warnings=tuple(warnings),
        n=request.n,
        echo=echo,
        split_reasoning=endpoint == "chat" and tokenizer.reasoning is not None,
        tools=plan,
        tool_parser=tokenizer.tool_parser if plan is not None else None,
    )


def chat_template_kwargs(
    request: ChatCompletionRequest, served: ServedModelSpec
) -> dict[str, Any] | None:
    """The chat template's extra variables: the model's prompt.enable_thinking and
    reasoning_effort (the request's reasoning_effort over the model's), then the request's
    own chat_template_kwargs over them."""
    kwargs = {
        **(served.prompt.template_kwargs(request.reasoning_effort) or {}),
        **(request.chat_template_kwargs or {}),
    }
    return kwargs or None


def usage_of_all(
    served: ServedModelSpec,
    results: list[GenerationResult],
    gpu_seconds: float,
    reasoning_tokens: int = 0,
) -> Usage:
    """`usage` of n choices of one prompt: the prompt once (its cached tokens as the first
    sample, which computed or found it, reports them), completion tokens and device time
    summed over all choices; `reasoning_tokens`: those of all choices (split answers)."""
    if len(results) == 1:
        return usage_of(served, results[0], gpu_seconds, reasoning_tokens)
    first = results[0]
    combined = dataclasses.replace(
        first, completion_tokens=sum(r.completion_tokens for r in results)
    )
    return usage_of(served, combined, gpu_seconds, reasoning_tokens)


def usage_of(
    served: ServedModelSpec,
    result: GenerationResult,
    gpu_seconds: float,
    reasoning_tokens: int = 0,
) -> Usage:
    return Usage(
        reasoning_tokens=reasoning_tokens,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_prompt_tokens,
        gpu_seconds=gpu_seconds,
        cost_usd=cost_usd(gpu_seconds, served.cost),
        list_price_usd=_list_price(served, result),
    )


def engine_unavailable(name: str, exc: Exception) -> ApiError:
    return ApiError(
        503,
        f"model '{name}' is unavailable right now ({type(exc).__name__}); retry shortly",
        type="server_error",
        code="engine_unavailable",
    )


def _list_price(served: ServedModelSpec, result: GenerationResult) -> float | None:
    """List price of the request's tokens; None without prices. An interactive request is
    priced as an online one: cost.batch_discount does not apply here."""
    if served.cost.price_per_million is None:
        return None
    online = served.cost.model_copy(update={"batch_discount": 0.0})
    return list_price_usd(
        result.prompt_tokens, result.cached_prompt_tokens, result.completion_tokens, online
    )


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _prompt_text(request: CompletionRequest, tokenizer: PromptTokenizer, ids: list[int]) -> str:
    """The prompt as echoed: the client's own text, or the decoding of its token ids."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def completion_prompt_ids(request: CompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
        return tokenizer.completion_ids(prompt)
    ids = list(prompt)
    vocab = tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(
            400,
            f"'prompt' holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
            param="prompt",
            code="invalid_value",
        )
    return ids


def capped_max_tokens(
    served: ServedModelSpec,
    info: EngineInfo,
    num_prompt: int,
    requested: int | None,
    default: int,
    prompt_param: str,
    param: str = "max_tokens",
) -> MaxTokens:
    """The request's max_tokens after the caps. A prompt that leaves no room is a 400 naming
    what to shorten; a max_tokens over the server's cap or the room the prompt leaves is
    clamped (the engines would stop at the context anyway, with finish_reason "length"), and
    the warning says so."""
    context = info.max_model_len
    prompt_cap = prompt_token_cap(served, info)
    if num_prompt > prompt_cap:
        raise ApiError(
            400,
            f"The prompt is {num_prompt} tokens; model '{served.name}' accepts at most "
            f"{prompt_cap} prompt tokens. Shorten the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = context - num_prompt  # >= 1: the prompt cap keeps one token free
    cap = served.limits.max_tokens
    if requested is None:
        return MaxTokens(max(1, min(default, cap, room)))
    value = min(requested, cap, room)
    if value == requested:
        return MaxTokens(value)
    # Name only the bound(s) that set the value, so the message says what to change.
    reasons = []
    if value == cap:
        reasons.append(f"model '{served.name}' allows at most {cap}")
    if value == room:
        reasons.append(
            f"the {num_prompt}-token {prompt_param} leaves {room} of the {context}-token context"
        )
    return MaxTokens(value, f"{param} {requested} clamped to {value} ({' and '.join(reasons)})")


def prompt_token_cap(served: ServedModelSpec, info: EngineInfo) -> int:
    """Most prompt tokens a request may bring: the model's limit, and one below the context."""
    context = info.max_model_len
    return min(served.limits.max_prompt_tokens or context - 1, context - 1)


def check_prompt_bytes(
    request: ChatCompletionRequest | CompletionRequest,
    served: ServedModelSpec,
    info: EngineInfo,
    max_bytes_per_token: int | None,
) -> None:
    """400 context_length_exceeded, before tokenizing, for a prompt whose byte length alone
    proves it has more tokens than the cap: B bytes are at least B / max_bytes_per_token
    tokens (pipeline.serve.protocol.tokens.bytes_per_token_bound). Chats count only the text of
    their user messages (stripped), which every chat template renders in full; the template's own
    text and other roles only add tokens, and templates may drop or trim other roles' text."""
    if max_bytes_per_token is None:
        return
    if isinstance(request, ChatCompletionRequest):
        size = sum(len(m.text.strip().encode()) for m in request.messages if m.role == "user")
        param = "messages"
    else:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return  # token ids: counted exactly, and cheaply, when converted
        size, param = len(prompt.encode()), "prompt"
    cap = prompt_token_cap(served, info)
    if size > cap * max_bytes_per_token:
        least = -(-size // max_bytes_per_token)
        raise ApiError(
            400,
            f"The prompt is at least {least} tokens ({size} bytes); model '{served.name}' "
            f"accepts at most {cap} prompt tokens. Shorten the {param}.",
            param=param,
            code="context_length_exceeded",
        )
