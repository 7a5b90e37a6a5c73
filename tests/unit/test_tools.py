"""Tool calls in the OpenAI layer (pipeline.openai.tools): reading a request's tools, the
constraining schema, each parser on fixed outputs written the way each family writes calls
(partial streams cut anywhere included), and the streamed split."""

from __future__ import annotations

import json
from typing import Any

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


def test_a_batch_line_with_tools_carries_them_to_its_columns() -> None:
    from pipeline.batch.stages.read.openai_batch import parse_batch_request

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": body}
    row = parse_batch_request(line)
    assert row["error"] is None
    assert json.loads(row["tools"]) == [WEATHER]
    assert json.loads(row["tool_choice"])["function"]["name"] == "get_weather"
    assert row["parallel_tool_calls"] is False
    # A choice naming a function the line does not define is that line's error, by field.
    bad = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert "tool_choice" in parse_batch_request({**line, "body": bad})["error"]
    off = {**body, "tools": [], "tool_choice": "none"}  # the neutral values pass, no tools
    row = parse_batch_request({**line, "body": off})
    assert row["error"] is None and row["tools"] is None


def _job(**prompt: Any) -> Any:
    from pipeline.spec import parse_job_spec

    return parse_job_spec(
        {
            "name": "tools",
            "input": {"uri": "in.jsonl", "format": "jsonl", "prompt_column": "text"},
            "model": {"path": "/models/tiny"},
            "output": {"uri": "out/"},
            "prompt": {"chat_template": True, "tools": [WEATHER, TIME], **prompt},
            "sampling": {"overrides": {"tools": "row_tools", "tool_choice": "row_choice"}},
        }
    )


def test_a_rows_tools_are_its_own_else_the_jobs_and_its_calls_have_stable_ids() -> None:
    from pipeline.batch.stages.tools import RowTools, read_calls, row_tools

    spec = _job(tool_choice="required")
    columns = {"tools": "row_tools", "tool_choice": "row_choice"}
    tools, problem = row_tools({"text": "hi"}, spec, columns, "<tool_call>")
    assert problem is None and tools is not None
    assert tools.plan.names == ["get_weather", "get_time"] and tools.plan.mode == "required"
    assert tools.parser == "hermes" and tools.response_format() is not None
    assert RowTools.from_cell(tools.cell()) == tools  # what the engine actor reads back
    own = {"text": "hi", "row_tools": json.dumps([TIME]), "row_choice": "auto"}
    mine, _ = row_tools(own, spec, columns, None)
    assert mine is not None and mine.plan.names == ["get_time"] and mine.response_format() is None
    _, problem = row_tools({**own, "row_choice": "always"}, spec, columns, None)
    assert problem is not None and problem.startswith("column 'row_choice':")
    off, problem = row_tools({**own, "row_choice": "none"}, spec, columns, None)
    assert off is None and problem is None  # offered, never called: a plain row

    content, calls = read_calls(mine.cell(), "row-1", HERMES)
    assert content == "Sure." and calls is not None
    assert [c["function"]["name"] for c in json.loads(calls)] == ["get_weather", "get_time"]
    assert read_calls(mine.cell(), "row-1", HERMES)[1] == calls  # a rerun: the same ids
    assert read_calls(mine.cell(), "row-2", HERMES)[1] != calls
    assert read_calls(mine.cell(), "row-1", "No call.") == ("No call.", None)


def test_a_jobs_tools_are_checked_before_it_starts() -> None:
    from pipeline.batch.stages.tools import check_job_tools
    from pipeline.spec import SpecError

    check_job_tools(_job())
    broken = {"type": "function", "function": {"name": "f", "parameters": []}}
    with pytest.raises(SpecError, match=r"prompt\.tools\[1\]\.function\.parameters"):
        check_job_tools(_job(tools=[WEATHER, broken]))
    with pytest.raises(SpecError, match=r"prompt\.tools: tools need a chat template"):
        check_job_tools(_job(chat_template=False))
    # A job-wide choice for rows that bring their own tools is fine; with no tools anywhere
    # it is refused by name.
    own = _job(tools=None, tool_choice="required")
    check_job_tools(own)
    nowhere = own.model_copy(update={"sampling": own.sampling.model_copy(update={"overrides": {}})})
    with pytest.raises(SpecError, match=r"prompt\.tool_choice: no row has tools"):
        check_job_tools(nowhere)
    spec = _job(tool_choice="required")
    formatted = spec.model_copy(
        update={
            "sampling": spec.sampling.model_copy(
                update={"response_format": {"type": "json_object"}}
            )
        }
    )
    with pytest.raises(SpecError, match=r"sampling\.response_format"):
        check_job_tools(formatted)


def test_harmony_calls_come_from_the_split_and_broken_ones_stay_content() -> None:
    from pipeline.spec import PromptSpec

    parser = choose_parser("<|start|>{{ m }}<|channel|>")
    assert parser.name == "harmony"
    plan = read_tools([WEATHER, TIME], None, None)
    assert plan is not None
    found = (("get_weather", '{"city": "Paris"}'), ("get_time", "{not json"))
    content, calls = answer_calls(plan, parser, "It is sunny.", found)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert content == "It is sunny.\n{not json"  # never dropped
    # Streamed: the text goes out as it comes (it holds no call); the calls at the end.
    stream = ToolStream(plan, parser)
    assert stream.feed("It is ") + stream.feed("sunny.") == "It is sunny."
    rest, streamed_calls = stream.close(found)
    assert rest == "\n{not json" and [c.name for c in streamed_calls] == ["get_weather"]
    assert answer_calls(plan, parser, "Plain.", ()) == ("Plain.", [])
    # A batch row reads them the same way; a broken call alone is content, not dropped.
    from pipeline.batch.stages.tools import RowTools, read_calls

    cell = RowTools(plan, "harmony").cell()
    text, row_calls = read_calls(cell, "r1", "It is sunny.", found)
    assert text == "It is sunny.\n{not json" and row_calls is not None
    assert read_calls(cell, "r1", "", found[1:]) == ("{not json", None)
    with pytest.raises(ValueError, match=r"prompt\.reasoning: harmony"):
        PromptSpec(tool_parser="harmony")
    assert PromptSpec(tool_parser="harmony", reasoning="harmony").tool_parser == "harmony"


def test_an_openai_batch_completions_line_is_never_offered_the_jobs_tools() -> None:
    from pipeline.batch.columns import MESSAGES, RESPONSE_FORMAT, SAMPLES, TOOL_PLAN
    from pipeline.batch.stages.prompts import PromptStage
    from pipeline.spec import parse_job_spec

    spec = parse_job_spec(
        {
            "name": "tools",
            "input": {"uri": "in.jsonl", "format": "openai_batch"},
            "model": {"path": "/models/tiny"},
            "output": {"uri": "out/"},
            "prompt": {"tools": [WEATHER], "tool_choice": "required"},
        }
    )
    stage = PromptStage.__new__(PromptStage)  # the row rules only: no tokenizer needed
    stage.spec, stage.overrides, stage.chat_template = spec, {}, None
    chat = {MESSAGES: [{"role": "user", "content": "hi"}]}
    completion = {MESSAGES: None}
    for row, planned in ((chat, True), (completion, False)):
        out = {SAMPLES: 1, RESPONSE_FORMAT: None, TOOL_PLAN: None}
        assert stage._tools(row, out) is None
        assert (out[TOOL_PLAN] is not None) == planned
        assert (out[RESPONSE_FORMAT] is not None) == planned  # the forced call's schema
