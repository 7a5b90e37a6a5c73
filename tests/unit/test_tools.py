"""Tool calls in the OpenAI layer (pipeline.openai.tools): reading a request's tools, the
constraining schema, each parser on fixed outputs written the way each family writes calls
(partial streams cut anywhere included), and the streamed split."""

from __future__ import annotations

import json

import pytest

from pipeline.openai.tools import (
    PARSERS,
    ToolError,
    ToolStream,
    answer_calls,
    call_schema,
    calls_from_constrained,
    choose_parser,
    read_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

HERMES = (
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_choice_modes_and_what_is_refused_names_the_field() -> None:
    plan = read_tools([WEATHER, TIME], None, None)
    assert plan is not None and plan.mode == "auto" and plan.parallel
    assert read_tools([WEATHER], "none", None).template_tools is None  # type: ignore[union-attr]
    named = read_tools(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False
    )
    assert named is not None and (named.mode, named.forced, named.parallel) == (
        "named",
        "get_time",
        False,
    )
    assert read_tools(None, None, None) is None
    bad = [
        (
            ([{"type": "function", "function": {"name": "x", "parameters": {"type": 3}}}], None),
            "tools[0].function.parameters",
        ),
        (([{"type": "code"}], None), "tools[0]"),
        (([WEATHER, WEATHER], None), "tools"),
        (([WEATHER], {"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (([WEATHER], "sometimes"), "tool_choice"),
        ((None, "required"), "tool_choice"),
    ]
    for (tools, choice), param in bad:
        with pytest.raises(ToolError) as caught:
            read_tools(tools, choice, None)
        assert caught.value.param == param, (tools, choice)
    turns = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    read_tools([TIME], None, None, turns)  # answers an earlier call
    with pytest.raises(ToolError) as caught:
        read_tools(
            [TIME], None, None, [*turns, {"role": "tool", "tool_call_id": "c9", "content": ""}]
        )
    assert caught.value.param == "messages[3].tool_call_id"


def test_constrained_schema_and_reading_it_back() -> None:
    import jsonschema

    plan = read_tools([WEATHER, TIME], "required", False)
    assert plan is not None
    schema = call_schema(plan)["json_schema"]["schema"]
    good = [{"name": "get_weather", "arguments": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel
        jsonschema.validate(good * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    assert _calls(calls_from_constrained(plan, json.dumps(good))) == [
        ("get_weather", {"city": "Rome"})
    ]
    assert calls_from_constrained(plan, '[{"name": "get_weather", "argu') == []  # cut short
    named = read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named is not None
    assert call_schema(named)["json_schema"]["schema"] == WEATHER["function"]["parameters"]
    assert _calls(calls_from_constrained(named, '{"city": "Oslo"}')) == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize(
    ("name", "text", "content"), [("hermes", HERMES, "Sure."), ("llama3_json", LLAMA, None)]
)
def test_each_parser_reads_its_family_and_leaves_broken_calls_as_content(
    name: str, text: str, content: str | None
) -> None:
    parser = PARSERS[name]
    got_content, calls = parser.parse(text)
    assert got_content == content and _calls(calls) == WANT
    assert parser.parse("Just an answer.") == ("Just an answer.", [])
    broken = text.replace('"city": "Paris"', '"city": Paris')
    assert parser.parse(broken) == (broken, [])


@pytest.mark.parametrize(
    ("name", "text", "content"), [("hermes", HERMES, "Sure."), ("llama3_json", LLAMA, None)]
)
def test_a_stream_cut_anywhere_sends_content_then_the_same_calls(
    name: str, text: str, content: str | None
) -> None:
    plan = read_tools([WEATHER, TIME], None, None)
    assert plan is not None
    for cut in range(1, len(text)):
        stream = ToolStream(plan, PARSERS[name])
        sent = stream.feed(text[:cut]) + stream.feed(text[cut:])
        rest, calls = stream.close()
        assert _calls(calls) == WANT, cut
        assert (sent + rest).strip() == (content or ""), cut
        assert "<tool_call>" not in sent and "{" not in sent and "python_tag" not in sent


def test_plain_answers_stream_through_and_parallel_false_keeps_the_first_call() -> None:
    plan = read_tools([WEATHER, TIME], None, None)
    assert plan is not None
    stream = ToolStream(plan, PARSERS["hermes"])
    text = "No tool needed: it is sunny <3"
    out = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.close()
    assert out + rest == text and calls == []
    single = read_tools([WEATHER, TIME], None, False)
    assert single is not None
    assert [c.name for c in answer_calls(single, PARSERS["hermes"], HERMES)[1]] == ["get_weather"]


def test_the_parser_follows_the_config_then_the_template() -> None:
    assert choose_parser("{{ '<tool_call>' }}").name == "hermes"
    assert choose_parser("{{ '<|python_tag|>' }} Environment: ipython").name == "llama3_json"
    assert choose_parser(None).name == "hermes"
    assert choose_parser("<tool_call>", "llama3_json").name == "llama3_json"
    with pytest.raises(ValueError, match="tool_parser 'x'"):
        choose_parser(None, "x")


def test_a_batch_line_with_tools_is_an_error_line_never_run_without_them() -> None:
    from pipeline.batch.stages.read.openai_batch import parse_batch_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": body}
    assert "unsupported body parameter tools" in parse_batch_request(line)["error"]
    off = {**body, "tools": [], "tool_choice": "none"}  # the neutral values still pass
    assert parse_batch_request({**line, "body": off})["error"] is None
