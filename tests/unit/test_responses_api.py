"""The Responses API over the chat path (pipeline.openai.responses_api), without a server: a
Responses body read into the chat body it asks for, chat's 400s restated in Responses fields,
and a chat answer written back whole and as a stream of events, the two agreeing."""

from __future__ import annotations

import json

import pytest

from pipeline.openai.errors import ApiError
from pipeline.openai.responses_api import ResponseEvents, frame, response_body, translate

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def test_input_items_become_the_chat_they_describe() -> None:
    got = translate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": "Checking."},
                {"type": "function_call", "call_id": "call_a", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_b", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_a", "output": "sun"},
                {"type": "function_call_output", "call_id": "call_b", "output": "rain"},
            ],
        }
    )
    roles = [(m["role"], m.get("content")) for m in got.chat["messages"]]
    assert roles == [
        ("system", "Be brief."),
        ("user", "Weather?"),
        ("assistant", "Checking."),  # the calls join the assistant turn before them
        ("tool", "sun"),
        ("tool", "rain"),
    ]
    calls = got.chat["messages"][2]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_a", "call_b"]
    assert got.chat["messages"][3]["tool_call_id"] == "call_a"
    # Chat paths map back to the items the client sent (the reasoning item left a gap).
    assert got.param("messages[2].tool_calls[1].function.arguments") == "input[4].arguments"
    assert got.param("messages[4].tool_call_id") == "input[6].call_id"
    assert got.param("messages[0]") == "instructions"


def test_fields_map_onto_chat_and_back() -> None:
    got = translate(
        {
            "model": "m",
            "input": "hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "object"}}},
            "reasoning": {"effort": "minimal"},
            "max_output_tokens": 9,
            "stream": True,
            "top_k": 5,
            "some_new_field": 1,
        }
    )
    chat = got.chat
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tools"][0]["function"]["strict"] is True
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["reasoning_effort"] == "low" and chat["max_completion_tokens"] == 9
    assert chat["stream_options"] == {"include_usage": True} and chat["top_k"] == 5
    assert chat["some_new_field"] == 1  # the chat parser warns about (or refuses) it
    assert got.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert got.param("tools[0].function.parameters") == "tools[0].parameters"
    assert got.param("response_format.json_schema.schema") == "text.format.schema"
    assert got.param("tool_choice.function.name") == "tool_choice.name"
    restated = got.restate(
        ApiError(400, "'max_completion_tokens' is too large", param="max_completion_tokens")
    )
    assert restated.param == "max_output_tokens"
    assert restated.message == "'max_output_tokens' is too large"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"messages": []}, "messages"),
        ({"n": 2}, "n"),
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].image_url",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "image_url": "data:,"}],
                    }
                ]
            },
            "input[0].output[0].type",
        ),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"instructions": 3}, "instructions"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        translate({"model": "m", "input": "hi", **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_input_image_parts_become_the_chats_image_parts_in_order() -> None:
    url = "data:image/png;base64,AAAA"
    content = [
        {"type": "input_text", "text": "Compare "},
        {"type": "input_image", "image_url": url, "detail": "low"},
        {"type": "input_image", "image_url": "https://img.example/a.png"},
        {"type": "input_text", "text": "please."},
    ]
    got = translate({"model": "m", "input": [{"role": "user", "content": content}]})
    (message,) = got.chat["messages"]
    assert message["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://img.example/a.png"}},
        {"type": "text", "text": "please."},
    ]
    # One chat part per Responses part: a chat error about a part names the same part here.
    assert got.param("messages[0].content[2].image_url") == "input[0].content[2].image_url"
    # Text parts alone still make one text.
    text = translate({"model": "m", "input": [{"role": "user", "content": content[::3]}]})
    assert text.chat["messages"][0]["content"] == "Compare please."


def _chat_chunks() -> list[dict | None]:
    head = {"id": "chatcmpl-abc", "model": "m", "created": 7, "object": "chat.completion.chunk"}

    def delta(d: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 9,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 3},
        "gpu_seconds": 0.5,
        "cost_usd": 0.001,
    }
    return [
        delta({"role": "assistant", "content": ""}),
        delta({"reasoning_content": "think "}),
        delta({"reasoning_content": "more"}),
        delta({"content": "Let me "}),
        delta({"content": "check."}),
        delta(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "w", "arguments": ""},
                    }
                ]
            }
        ),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}),
        delta({}, "tool_calls"),
        {**head, "choices": [], "usage": usage},
        None,
    ]


def _whole_chat() -> dict:
    chunks = _chat_chunks()
    return {
        "id": "chatcmpl-abc",
        "model": "m",
        "created": 7,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me check.",
                    "reasoning_content": "think more",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": chunks[-2]["usage"],
    }


def test_a_stream_and_a_whole_answer_agree() -> None:
    echo = translate({"model": "m", "input": "hi", "tools": [WEATHER]}).echo
    whole = response_body(_whole_chat(), echo)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["status"] == "completed" and whole["id"] == "resp_abc"
    assert whole["usage"]["input_tokens_details"] == {"cached_tokens": 2}
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert whole["usage"]["cost_usd"] == 0.001 and whole["store"] is False
    call = whole["output"][2]
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "w", '{"city": "Oslo"}')

    stream = ResponseEvents("resp_abc", "m", 7, echo)
    events = stream.start()
    for chunk in _chat_chunks():
        if chunk is not None:
            events.extend(stream.feed(chunk))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
    ]
    assert events[-1]["response"] == whole  # the same Response, streamed or not
    wire = frame(events[0]).decode()
    assert wire.startswith("event: response.created\ndata: ")
    assert json.loads(wire.split("data: ", 1)[1]) == events[0]


def test_a_cut_answer_is_incomplete_and_a_failure_is_failed() -> None:
    echo = translate({"model": "m", "input": "hi"}).echo
    chat = _whole_chat()
    chat["choices"][0]["finish_reason"] = "length"
    cut = response_body(chat, echo)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}

    stream = ResponseEvents("resp_abc", "m", 7, echo)
    stream.start()
    stream.feed(_chat_chunks()[3])
    events = stream.feed({"error": {"message": "engine died", "code": "engine_unavailable"}})
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[1]["response"]["error"] == {
        "code": "engine_unavailable",
        "message": "engine died",
    }
    assert stream.feed(_chat_chunks()[4]) == []  # nothing after the end


def test_a_batch_line_of_responses_runs_as_its_chat_request() -> None:
    from pipeline.batch.columns import BATCH_OVERRIDE_COLUMNS, MESSAGES
    from pipeline.batch.stages.read.openai_batch import parse_batch_request

    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": "Weather?",
        "max_output_tokens": 7,
        "temperature": 0.5,
        "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "high"},
    }
    parsed = parse_batch_request({"custom_id": "a", "url": "/v1/responses", "body": body})
    assert parsed["error"] is None
    assert json.loads(parsed[MESSAGES]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
    ]
    assert parsed[BATCH_OVERRIDE_COLUMNS["max_tokens"]] == 7
    assert parsed[BATCH_OVERRIDE_COLUMNS["temperature"]] == 0.5
    assert parsed[BATCH_OVERRIDE_COLUMNS["reasoning_effort"]] == "high"
    assert "json_object" in parsed[BATCH_OVERRIDE_COLUMNS["response_format"]]
    # A line's errors name the Responses field it sent.
    bad = {
        **body,
        "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}],
    }
    error = parse_batch_request({"custom_id": "b", "url": "/v1/responses", "body": bad})["error"]
    assert error.startswith("body.input[0].call_id"), error
    stored = {**body, "store": True}
    error = parse_batch_request({"custom_id": "c", "url": "/v1/responses", "body": stored})["error"]
    assert "store" in error


def test_a_batch_output_line_of_responses_is_a_response() -> None:
    import datetime as dt

    from pipeline.batch.driver.openai_output import LineContext, output_line

    row = {
        "id": "req-1",
        "url": "/v1/responses",
        "text": "Sunny.",
        "reasoning": "look outside",
        "reasoning_tokens": 2,
        "finish_reason": "stop",
        "error": None,
        "prompt_tokens": 12,
        "cached_prompt_tokens": 4,
        "completion_tokens": 5,
        "gpu_seconds": 0.5,
        "cost_usd": 0.001,
        "model": "tiny",
        "actor_id": "actor-1",
        "finished_at": dt.datetime(2026, 5, 1, tzinfo=dt.timezone.utc),
    }
    line = output_line(row, LineContext(job_key="f" * 64, list_prices=False), "part-0.parquet", 0)
    body = line["response"]["body"]
    assert body["object"] == "response" and body["id"] == "resp_" + line["response"]["request_id"]
    assert body["status"] == "completed" and body["model"] == "tiny"
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["content"][0]["text"] == "Sunny."
    assert body["usage"]["input_tokens"] == 12 and body["usage"]["output_tokens"] == 5
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
