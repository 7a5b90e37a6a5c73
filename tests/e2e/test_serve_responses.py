"""`/v1/responses` through `tokenmill serve` and the official openai client (`responses.create`,
`responses.stream`, `responses.parse`): text, structured output (a JSON schema on random
weights: constrained decoding makes it valid), tool calls required and named on the tiny model,
auto on the `scripted` synthetic model (text and two Hermes calls), a second turn carrying the
calls and their outputs as input items, an answer cut at max_output_tokens, and the 400s that
name the Responses field. The shared server: serve_fixtures.server; reasoning items are in
test_serve_reasoning.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.serve_fixtures import API_KEY, ServerProcess

WEATHER = {
    "type": "function",
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
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = "What is the weather in Paris?"
SCRIPTED_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_time", {"city": "Paris"}),
]


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    rain: bool


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


def _calls(response) -> list[tuple[str, dict]]:
    out = []
    for item in response.output:
        if item.type == "function_call":
            arguments = json.loads(item.arguments)
            jsonschema.validate(arguments, SCHEMAS[item.name])
            assert item.call_id.startswith("call_") and item.id.startswith("fc_")
            out.append((item.name, arguments))
    return out


def test_text_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.model == "tiny" and whole.instructions == "Be brief."
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text and whole.output[0].content[0].type == "output_text"
    usage = whole.usage
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    # Eight tokens of random weights: cut by max_output_tokens, as OpenAI reports it.
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    # The instructions are rendered: the system turn adds to the input.
    shorter = client.responses.create(model="tiny", input=ASK, max_output_tokens=8, temperature=0)
    assert shorter.usage.input_tokens < usage.input_tokens


def test_streamed_text_completes_with_usage(client: openai.OpenAI) -> None:
    with client.responses.stream(model="scripted", input=ASK, max_output_tokens=200) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.usage.output_tokens > 0
    # No tools in the request: the scripted calls stay text, whole.
    assert final.output_text == deltas and "<tool_call>" in deltas


def test_json_schema_output_parses_from_random_weights(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model="tiny", input="A forecast, please.", text_format=Forecast, max_output_tokens=120
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Forecast)
    with client.responses.stream(
        model="tiny", input="A forecast, please.", text_format=Forecast, max_output_tokens=120
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Forecast)


def test_required_and_named_calls_are_valid(client: openai.OpenAI) -> None:
    required = client.responses.create(
        model="tiny",
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    assert required.status == "completed" and len(_calls(required)) == 1
    assert required.tool_choice == "required"
    with client.responses.stream(
        model="tiny",
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [name for name, _ in _calls(final)] == ["get_weather"]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds


def test_auto_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="scripted", input=ASK, tools=TOOLS, max_output_tokens=200)
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me check."
    assert _calls(whole) == SCRIPTED_CALLS
    with client.responses.stream(
        model="scripted", input=ASK, tools=TOOLS, max_output_tokens=200
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text.strip() == "Let me check."
    assert _calls(final) == SCRIPTED_CALLS
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call", "function_call"]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))


def test_a_second_turn_carries_calls_and_outputs(client: openai.OpenAI) -> None:
    first = client.responses.create(model="scripted", input=ASK, tools=TOOLS, max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    turns = [
        {"role": "user", "content": ASK},
        *(item.model_dump(exclude_none=True) for item in first.output),
        *(
            {"type": "function_call_output", "call_id": c.call_id, "output": '{"ok": 1}'}
            for c in calls
        ),
    ]
    second = client.responses.create(
        model="tiny", input=turns, tools=TOOLS, max_output_tokens=2, temperature=0
    )
    alone = client.responses.create(model="tiny", input=ASK, tools=TOOLS, max_output_tokens=1)
    # The calls and outputs are part of the prompt the chat template rendered.
    assert second.usage.input_tokens > alone.usage.input_tokens + 20


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "parameters": {"type": 7}}]}, "tools[0].parameters"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": ASK}, {"type": "item_reference", "id": "x"}]},
            "input[1].type",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": ASK},
                    {"type": "function_call_output", "call_id": "call_never", "output": "{}"},
                ]
            },
            "input[1].call_id",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_file", "file_id": "file-1"}],
                    }
                ]
            },
            "input[0].content[0].type",
        ),
        (  # images are read, but this model takes text only (the message names the part)
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}],
                    }
                ]
            },
            "input",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, changes: dict, param: str
) -> None:
    body = {"model": "tiny", "input": ASK, "tools": TOOLS, "max_output_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**body)
    assert caught.value.body["param"] == param, caught.value.body
