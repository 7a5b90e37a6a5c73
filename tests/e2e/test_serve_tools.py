"""Tool calls through `tokenmill serve` and the official openai client: tool_choice required and
named on the tiny model (random weights; constrained decoding makes every call valid under its
function's schema), auto on the `scripted` synthetic model (its reply is text and two Hermes
calls, so the parser's path runs), streamed and not, a second turn carrying the tool's result,
and the 400s that name what is wrong. The shared server: serve_fixtures.server."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.serve_fixtures import API_KEY, ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


def _valid(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index {id, name, arguments}, finish_reason) from a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_gives_valid_calls_from_random_weights(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(_valid(choice.message.tool_calls)) == 1


def test_named_streams_its_call_by_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    content, calls, finish = _streamed(stream)
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_auto_parses_what_the_model_wrote_whole_and_streamed(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, max_tokens=200
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert _valid(choice.message.tool_calls) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"city": "Paris"}),
    ]
    stream = client.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, max_tokens=200, stream=True
    )
    content, calls, finish = _streamed(stream)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"city": "Paris"}),
    ]
    # parallel_tool_calls false: the first call only; tool_choice none: no calls, the text.
    one = client.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=200
    )
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    none = client.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" in none.choices[0].message.content


def test_a_second_turn_carries_the_calls_and_their_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="scripted", messages=ASK, tools=TOOLS, max_tokens=200
    )
    message = first.choices[0].message
    turns = [
        *ASK,
        message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": call.id})}
            for call in message.tool_calls
        ),
    ]
    second = client.chat.completions.create(
        model="tiny", messages=turns, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The calls and results are part of the prompt the template rendered.
    alone = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        (
            {"tools": [{**WEATHER, "function": {"name": "w", "parameters": {"type": 7}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "tool", "tool_call_id": "call_never", "content": "{}"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(
    client: openai.OpenAI, changes: dict, param: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    assert caught.value.body["param"] == param, caught.value.body
