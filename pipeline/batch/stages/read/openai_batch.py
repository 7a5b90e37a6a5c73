"""OpenAI Batch API lines (`input.format: openai_batch`): one request per line, by custom_id.

`parse_batch_request` turns one line's JSON object into the prompt or chat, the per-request
sampling values and an error for what the pipeline cannot serve (another endpoint, best_of,
...): such a request becomes an error row naming the parameter, never a silent skip. A chat
line's tools, tool_choice and parallel_tool_calls go to their columns for the prompt stage.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.batch.columns import (
    ADAPTER,
    BATCH_OVERRIDE_COLUMNS,
    BODY_SAMPLING,
    ERROR,
    ID,
    MESSAGES,
    PROMPT,
)
from pipeline.batch.stages.read.cells import (
    apply_overrides,
    coerce_override,
    has_adapters,
    json_cell,
    model_adapter,
)
from pipeline.openai.errors import ApiError
from pipeline.openai.models import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from pipeline.openai.responses_api import Translation, translate
from pipeline.openai.sampling import SamplingError, resolve
from pipeline.spec import JobSpec

EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"  # read into the chat request it asks for (responses_api)
SUPPORTED_BATCH_URLS = ("/v1/chat/completions", "/v1/completions", RESPONSES_URL, EMBEDDINGS_URL)
# openai_batch: sampling field -> the column its per-request value lands in.
# Request body parameters that would change results and that the pipeline does not implement:
# name -> predicate on the value saying "this value needs the feature".
# Batch-only refusals; the parameters Serve refuses too are in pipeline.openai.params.REFUSED,
# and the supported sampling ones (penalties, logit_bias, stop, ...) in its BATCH_SAMPLING.
UNSUPPORTED_BODY: dict[str, Any] = {
    "echo": lambda v: bool(v),
    "stream": lambda v: bool(v),
}


def parse_batch_request(obj: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI Batch API line → custom_id, prompt/messages, override values, or an error.

    Returns a dict with keys `custom_id` (may be None), `prompt`, `messages` (JSON text),
    the BATCH_OVERRIDE_COLUMNS, BODY_SAMPLING and `error`.
    """
    out: dict[str, Any] = {"custom_id": None, PROMPT: None, MESSAGES: None, ERROR: None}
    custom_id = obj.get("custom_id")
    if custom_id is None or custom_id == "":
        out[ERROR] = "missing custom_id"
        return out
    out["custom_id"] = str(custom_id)
    url = obj.get("url")
    if url not in SUPPORTED_BATCH_URLS:
        out[ERROR] = f"unsupported url {url!r}; supported: {', '.join(SUPPORTED_BATCH_URLS)}"
        return out
    method = obj.get("method", "POST")
    if str(method).upper() != "POST":
        out[ERROR] = f"unsupported method {method!r}; batch requests are POST"
        return out
    body = obj.get("body")
    if not isinstance(body, dict):
        out[ERROR] = "missing body (an object with messages or prompt)"
        return out
    if url == EMBEDDINGS_URL:
        out.update(_embedding_input(body))
        return out
    for name, needs_feature in UNSUPPORTED_BODY.items():
        if name in body and needs_feature(body[name]):
            out[ERROR] = f"unsupported body parameter {name}={body[name]!r}"
            return out
    responses: Translation | None = None
    if url == RESPONSES_URL:
        # The chat request the Responses body asks for; errors name the Responses field.
        try:
            responses = translate(body)
        except ApiError as exc:
            out[ERROR] = _body_error(body, exc)
            return out
        body, url = responses.chat, "/v1/chat/completions"
    # Read with the very request models Serve reads its requests with: the same fields,
    # shapes, bounds and refusals, so a line means what the same request sent to the
    # endpoint means.
    chat = url == "/v1/chat/completions"
    if chat and (not isinstance(body.get("messages"), list) or not body["messages"]):
        out[ERROR] = "body.messages must be a non-empty list for /v1/chat/completions"
        return out
    if not body.get("model"):  # a job names its model: its lines may leave it out
        body = {**body, "model": "-"}
    try:
        request = parse_chat_request(body) if chat else parse_completion_request(body)
        logprobs = request.requested_logprobs
    except ApiError as exc:
        out[ERROR] = _body_error(body, exc if responses is None else responses.restate(exc))
        return out
    shared = _shared_sampling(request)
    try:  # ranges now, so a bad value is this line's error before any rendering
        resolve({"max_tokens": max(1, shared.get("min_tokens", 0)), **shared})
    except SamplingError as exc:
        out[ERROR] = f"body.{exc.field}: {exc}"
        return out
    out[BODY_SAMPLING] = json.dumps(shared, sort_keys=True) if shared else None
    if chat:
        out[MESSAGES] = json.dumps(body["messages"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            out[ERROR] = "body.prompt must be one string for /v1/completions"
            return out
        out[PROMPT] = prompt
    sent = request.model_fields_set  # a field the line left out takes the job's default
    values = {
        "max_tokens": request.requested_max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "response_format": request.response_format,
        "logprobs": logprobs,
        "n": request.n if "n" in sent else None,
        "reasoning_effort": getattr(request, "reasoning_effort", None),  # the chat template's
        "tools": None,
        "tool_choice": None,
        "parallel_tool_calls": None,
    }
    plan = request.tool_plan if isinstance(request, ChatCompletionRequest) else None
    if plan is not None:
        # Checked already (read_tools); the prompt stage reads them again into the row's plan.
        values["tools"] = list(plan.tools)
        values["tool_choice"] = json.dumps(request.tool_choice) if request.tool_choice else None
        values["parallel_tool_calls"] = request.parallel_tool_calls
    for field, value in values.items():
        column = BATCH_OVERRIDE_COLUMNS[field]
        coerced, problem = coerce_override(field, column, value, label=f"body.{field}")
        out[column] = coerced
        if problem:
            out[ERROR] = problem
            return out
    return out


def _shared_sampling(request: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The line's SamplingParams values that have no column of their own (the shared table's
    penalties, bias, stop, ...), as the row's BODY_SAMPLING JSON carries them."""
    shared: dict[str, Any] = dict(request.sampling_values)
    if request.stop_list:
        shared["stop"] = list(request.stop_list)
    if request.stop_token_ids:
        shared["stop_token_ids"] = list(request.stop_token_ids)
    if request.top_k is not None:
        shared["top_k"] = request.top_k_value
    if request.ignore_eos is not None:
        shared["ignore_eos"] = request.ignore_eos
    if "bad_words" in shared:
        shared["bad_words"] = list(shared["bad_words"])
    return shared


def _body_error(body: dict[str, Any], exc: ApiError) -> str:
    """A line's error from the request models' 400, naming the body field."""
    if exc.code == "unsupported_parameter" and exc.param in body:
        return (
            f"unsupported body parameter {exc.param}={body[exc.param]!r}: remove it or send "
            "its default"
        )
    return f"body.{exc.param}: {exc}" if exc.param else f"body: {exc}"


def _embedding_input(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/embeddings line: its one text as the prompt, or the error. A line embeds one
    input, as float: a batch's output line is one embedding's response body."""
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str) or not text:
        return {ERROR: "body.input must be one non-empty string for /v1/embeddings in a batch"}
    if body.get("encoding_format", "float") not in (None, "float"):
        return {ERROR: "body.encoding_format must be float in a batch (or left out)"}
    if body.get("dimensions") is not None:
        return {ERROR: "unsupported body parameter dimensions: remove it"}
    return {PROMPT: text}


def batch_row(spec: JobSpec, obj: dict[str, Any], row: dict[str, Any], where: str) -> None:
    parsed = parse_batch_request(obj)
    if parsed["custom_id"] is not None:
        row[ID] = parsed["custom_id"]
    for name in (PROMPT, MESSAGES, BODY_SAMPLING, *BATCH_OVERRIDE_COLUMNS.values()):
        row[name] = parsed.get(name)
    for name in spec.input.passthrough_columns:
        row[name] = json_cell(obj.get(name))
    # User overrides may point at top-level keys of the line (rare, but allowed).
    apply_overrides(
        spec, row, {k: v for k, v in obj.items() if k in spec.sampling.overrides.values()}, where
    )
    url = obj.get("url")
    if url in SUPPORTED_BATCH_URLS and (url == EMBEDDINGS_URL) != (spec.task == "embed"):
        # A job either embeds every line or generates for every line; a line of the other
        # kind is told so first, before anything about its body.
        row[ERROR] = (
            f"{where}: url {obj.get('url')} does not fit this job's task {spec.task} "
            f"(/v1/embeddings lines need task embed; the others, task generate)"
        )
    elif parsed[ERROR]:
        row[ERROR] = f"{where}: {parsed[ERROR]}"
    body = obj.get("body")
    if has_adapters(spec):
        adapter, problem = model_adapter(
            spec, body.get("model") if isinstance(body, dict) else None
        )
        row[ADAPTER] = adapter
        if problem and not row.get(ERROR):
            row[ERROR] = f"{where}: {problem}"
