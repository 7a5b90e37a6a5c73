"""Reasoning output through `tokenmill serve` (real HTTP, the official OpenAI client): models
on the shared server (tests/e2e/serve_fixtures.py), `<think>` (Qwen3) and harmony (GPT-OSS),
each on the synthetic engine scripted to write a known reasoning part and answer in its tiny
model's tokens, so content, reasoning_content (whole and streamed) and the usage counts are
known exactly; and `harmony-tools`, GPT-OSS writing two tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.serve_fixtures import (
    API_KEY,
    HARMONY_CALLS_SCRIPT,
    REASONING_ANSWER,
    REASONING_SCRIPTS,
    ServerProcess,
)

pytestmark = pytest.mark.timeout(400)

CHAT = [{"role": "user", "content": "Why is the river cold?"}]
ANSWER = REASONING_ANSWER


@dataclass(frozen=True)
class Format:
    """A reasoning format's scripted reply: what the synthetic engine writes, and its split."""

    script: str
    reasoning: str


FORMATS = {fmt: Format(script, reasoning) for fmt, (script, reasoning) in REASONING_SCRIPTS.items()}


HARMONY_CALLS = HARMONY_CALLS_SCRIPT
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})]


@dataclass(frozen=True)
class Expected:
    """Exact figures, from the model's own tokenizer."""

    reasoning_tokens: int
    completion_tokens: int  # every token written, the format's markers and the end too
    cut: int  # a max_tokens that stops two tokens into the reasoning text
    cut_reasoning: str  # the reasoning then (2 reasoning tokens)


@pytest.fixture(scope="module")
def tokenizers(reasoning_models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {fmt: AutoTokenizer.from_pretrained(str(path)) for fmt, path in reasoning_models.items()}


@pytest.fixture(scope="module")
def expected(tokenizers: dict[str, Any]) -> dict[str, Expected]:
    out = {}
    for fmt, spec in FORMATS.items():
        tok = tokenizers[fmt]
        ids = tok.encode(spec.script, add_special_tokens=False)
        # Where the reasoning text starts: after the analysis header for harmony.
        head = 0 if fmt == "think" else ids.index(tok.convert_tokens_to_ids("<|message|>")) + 1
        # <think>: every token before </think> (the newline too); harmony: the analysis
        # message's own tokens (its header and markers are the format's).
        if fmt == "think":
            reasoning_tokens = ids.index(tok.convert_tokens_to_ids("</think>"))
        else:
            reasoning_tokens = len(tok.encode(spec.reasoning, add_special_tokens=False))
        out[fmt] = Expected(
            reasoning_tokens=reasoning_tokens,
            completion_tokens=len(ids) + 1,
            cut=head + 2,
            cut_reasoning=tok.decode(ids[head : head + 2]).strip(),
        )
    return out


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_whole_answer(
    client: openai.OpenAI, fmt: str, expected: dict[str, Expected], tokenizers: dict[str, Any]
) -> None:
    want, tok = expected[fmt], tokenizers[fmt]
    reply = client.chat.completions.create(model=fmt, messages=CHAT, max_tokens=64)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == FORMATS[fmt].reasoning
    assert reply.usage.completion_tokens == want.completion_tokens  # tokens are tokens
    assert reply.usage.completion_tokens_details.reasoning_tokens == want.reasoning_tokens
    # reasoning_effort is accepted and reaches the template: the prompt is the one the
    # model's own template renders with it.
    effort = client.chat.completions.create(
        model=fmt, messages=CHAT, max_tokens=64, reasoning_effort="high"
    )
    rendered = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False, reasoning_effort="high"
    )
    assert "Reasoning: high" in rendered
    assert effort.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert effort.choices[0].message.content == ANSWER
    # n choices: each split, the usage counting every choice's reasoning.
    two = client.chat.completions.create(
        model=fmt, messages=CHAT, max_tokens=64, n=2, temperature=1.0
    )
    assert [c.message.model_extra["reasoning_content"] for c in two.choices] == [
        FORMATS[fmt].reasoning
    ] * 2
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * want.reasoning_tokens
    # Cut at max_tokens inside the reasoning: all reasoning so far, an empty answer.
    cut = client.chat.completions.create(model=fmt, messages=CHAT, max_tokens=want.cut)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content == ""
    assert cut.choices[0].message.model_extra["reasoning_content"].strip() == want.cut_reasoning
    assert cut.usage.completion_tokens_details.reasoning_tokens == 2


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streamed_answer(client: openai.OpenAI, fmt: str, expected: dict[str, Expected]) -> None:
    want = expected[fmt]
    stream = client.chat.completions.create(
        model=fmt,
        messages=CHAT,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[tuple[str, str]] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                parts.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                parts.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # reasoning first
    assert kinds.count("reasoning") > 1  # really streamed, not one piece at the end
    assert "".join(t for k, t in parts if k == "reasoning") == FORMATS[fmt].reasoning
    assert "".join(t for k, t in parts if k == "content") == ANSWER
    assert usage is not None
    assert usage.completion_tokens == want.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == want.reasoning_tokens


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_responses_carry_a_reasoning_item(
    client: openai.OpenAI, fmt: str, expected: dict[str, Expected], tokenizers: dict[str, Any]
) -> None:
    """/v1/responses: the reasoning as a reasoning item before the message (whole and
    streamed), its tokens in output_tokens_details, reasoning.effort reaching the template."""
    want, tok = expected[fmt], tokenizers[fmt]
    whole = client.responses.create(model=fmt, input=CHAT, max_output_tokens=64)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == FORMATS[fmt].reasoning
    assert whole.output_text == ANSWER
    assert whole.usage.output_tokens == want.completion_tokens
    assert whole.usage.output_tokens_details.reasoning_tokens == want.reasoning_tokens
    effort = client.responses.create(
        model=fmt, input=CHAT, max_output_tokens=64, reasoning={"effort": "high"}
    )
    rendered = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False, reasoning_effort="high"
    )
    assert effort.usage.input_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert effort.reasoning.effort == "high"
    with client.responses.stream(model=fmt, input=CHAT, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == FORMATS[fmt].reasoning and said == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == want.reasoning_tokens


def test_harmony_tool_calls_whole_streamed_and_as_a_response(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris, time in Rome?"}]
    reply = client.chat.completions.create(
        model="harmony-tools", messages=ask, tools=TOOLS, max_tokens=200
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS

    stream = client.chat.completions.create(
        model="harmony-tools", messages=ask, tools=TOOLS, max_tokens=200, stream=True
    )
    content, names, arguments, finish = "", {}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for part in c.delta.tool_calls or []:
                if part.function and part.function.name:
                    names[part.index] = part.function.name
                if part.function and part.function.arguments:
                    arguments[part.index] = arguments.get(part.index, "") + part.function.arguments
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == CALLS

    # Without tools the calls are no answer: the text is empty, nothing parsed.
    plain = client.chat.completions.create(model="harmony-tools", messages=ask, max_tokens=200)
    assert plain.choices[0].message.tool_calls is None

    # The second turn renders the calls and their results through the model's template.
    turn = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls),
    ]
    again = client.chat.completions.create(
        model="harmony-tools", messages=turn, tools=TOOLS, max_tokens=200
    )
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens

    response = client.responses.create(
        model="harmony-tools",
        input="Weather in Paris?",
        tools=[{"type": "function", **t["function"]} for t in TOOLS],
        max_output_tokens=200,
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call", "function_call"], kinds
    assert [(i.name, json.loads(i.arguments)) for i in response.output[1:]] == CALLS
