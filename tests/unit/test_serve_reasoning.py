"""Serve's side of reasoning output, without Ray: reasoning_effort reaches the chat template
(the request's over the model's, chat_template_kwargs over both), and response bodies carry
reasoning_content and completion_tokens_details.reasoning_tokens."""

from __future__ import annotations

import pytest

from engines.api import EngineInfo
from pipeline.openai.errors import ApiError
from pipeline.openai.models import parse_completion_request
from pipeline.openai.responses import Choice, ResponseIds, Usage, choices_body, chunk_body
from pipeline.serve.protocol.requests import parse_request, to_engine_request
from pipeline.serve.spec import ServedModelSpec

MESSAGES = [{"role": "user", "content": "hi"}]


class _Tokenizer:
    """PromptTokenizer's interface: one token per character, template kwargs recorded."""

    has_chat_template = True
    vocab_size = 1000

    def __init__(self, reasoning: object = None) -> None:
        self.reasoning = reasoning
        self.template_kwargs: dict | None = None

    def chat_ids(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        self.template_kwargs = template_kwargs
        return [ord(c) for m in messages for c in m["content"]]

    def completion_ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _served(**prompt: object) -> ServedModelSpec:
    return ServedModelSpec.model_validate({"name": "m", "model": {"path": "/x"}, "prompt": prompt})


INFO = EngineInfo("reference", "/x", 4096, "cpu", 1, "float32", True)


def _prepare(body: dict, served: ServedModelSpec, tokenizer: _Tokenizer, endpoint: str = "chat"):
    request = parse_request({"model": "m", **body}, endpoint)  # type: ignore[arg-type]
    return to_engine_request(request, endpoint, served, tokenizer, INFO)  # type: ignore[arg-type]


def test_reasoning_effort_reaches_the_template() -> None:
    tok = _Tokenizer()
    served = _served(reasoning_effort="low", enable_thinking=True)
    _prepare({"messages": MESSAGES}, served, tok)
    assert tok.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    _prepare({"messages": MESSAGES, "reasoning_effort": "high"}, served, tok)
    assert tok.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    _prepare(body, served, tok)
    assert tok.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    _prepare({"messages": MESSAGES}, _served(), tok)
    assert tok.template_kwargs is None
    with pytest.raises(ApiError) as err:
        _prepare({"messages": MESSAGES, "reasoning_effort": "extreme"}, served, tok)
    assert err.value.param == "reasoning_effort"


def test_only_chat_on_a_reasoning_model_is_split() -> None:
    parser = object()
    assert _prepare({"messages": MESSAGES}, _served(), _Tokenizer(parser)).split_reasoning
    assert not _prepare({"messages": MESSAGES}, _served(), _Tokenizer()).split_reasoning
    raw = _prepare({"prompt": "x"}, _served(), _Tokenizer(parser), "completions")
    assert not raw.split_reasoning
    # /v1/completions takes no reasoning_effort: ignored (named in the warning header).
    completion = parse_completion_request({"model": "m", "prompt": "x", "reasoning_effort": "low"})
    assert completion.ignored_fields == ("reasoning_effort",)


def test_bodies_carry_reasoning() -> None:
    usage = Usage(10, 9, 0, 0.1, 0.0, None, reasoning_tokens=6)
    assert usage.body()["completion_tokens_details"] == {"reasoning_tokens": 6}
    assert Usage(1, 1, 0, 0.1, 0.0, None).body()["completion_tokens_details"] == {
        "reasoning_tokens": 0
    }
    ids = ResponseIds.new("chat", "r", "m")
    body = choices_body(ids, [Choice("Cold.", "stop", None, "north"), Choice("x", "stop")], usage)
    first, second = (c["message"] for c in body["choices"])
    assert first == {
        "role": "assistant",
        "content": "Cold.",
        "refusal": None,
        "reasoning_content": "north",
    }
    assert "reasoning_content" not in second  # no reasoning part: no field
    assert chunk_body(ids, reasoning="nor")["choices"][0]["delta"] == {"reasoning_content": "nor"}
    both = chunk_body(ids, text="Co", reasoning="th")["choices"][0]["delta"]
    assert both == {"reasoning_content": "th", "content": "Co"}
    assert chunk_body(ids, text="Co")["choices"][0]["delta"] == {"content": "Co"}
