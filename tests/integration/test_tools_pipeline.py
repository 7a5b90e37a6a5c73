"""Tool calls in batch rows: OpenAI batch lines on the S3 server through `run_job` (tiny model,
random weights: tool_choice required and named constrain every answer to valid calls), with
the export files in OpenAI's shapes; processor rows on the synthetic engine scripted to write
text and two Hermes calls (the `auto` path through the parser), with the job's tools and a
row's own choice; and what is refused before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.batch.driver.run import run_job
from pipeline.spec import SpecError
from tests.e2e.serve_fixtures import TOOL_SCRIPT
from tests.e2e.test_serve_tools import ASK, SCHEMAS, TOOLS, WEATHER
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import assert_exactly_once, make_spec, read_output

pytestmark = pytest.mark.timeout(600)

SCRIPT = TOOL_SCRIPT  # what the scripted synthetic engine writes: text, two Hermes calls


def _valid(calls: list[dict[str, Any]]) -> list[str]:
    """The names of `calls` (OpenAI's tool_calls), each checked against its function's schema."""
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )
    return [c["function"]["name"] for c in calls]


def _chat(i: int, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 160, "temperature": 0.8, **body}
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _responses(i: int, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "input": "Weather in Rome?", "max_output_tokens": 160, **body}
    return {"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses", "body": body}


def test_openai_batch_lines_with_tools(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    lines = [
        # One call each (parallel_tool_calls false), sampled: a different valid call per seed.
        *(
            _chat(i, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=i)
            for i in range(4)
        ),
        _chat(4, tools=TOOLS, tool_choice=named),
        _chat(5, max_tokens=4),  # no tools: a plain answer, tool_calls null
        _chat(6, tools=TOOLS, tool_choice="none", max_tokens=4),  # tools offered, none called
        _responses(
            7,
            tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice="required",
            parallel_tool_calls=False,
        ),
        _responses(8, input="Hello?", max_output_tokens=4),
        # Bad lines are error rows naming the field; the rest of the job goes on.
        _chat(9, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        _chat(
            10,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        ),
    ]
    bucket = s3_server.make_bucket()
    s3_server.put(f"s3://{bucket}/in/lines.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "tools-batch",
        {
            "uri": f"s3://{bucket}/in/lines.jsonl",
            "format": "openai_batch",
            "passthrough_columns": ["url"],
        },
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        limits={"max_error_fraction": 0.5},
        output={"rows_per_file": 4, "format": "openai_batch"},
    )
    result = run_job(spec)
    assert result.status == "complete"
    table, names = read_output(s3_server, spec.output.uri)
    assert_exactly_once(table, [x["custom_id"] for x in lines])
    rows = {r["id"]: r for r in table.to_pylist()}

    for i in range(4):  # required: one or more valid calls, whatever the random weights say
        row = rows[f"chat-{i}"]
        assert row["finish_reason"] == "tool_calls", row
        assert len(_valid(json.loads(row["tool_calls"]))) == 1
    assert _valid(json.loads(rows["chat-4"]["tool_calls"])) == ["get_time"]
    for plain in ("chat-5", "chat-6", "resp-8"):
        assert rows[plain]["tool_calls"] is None and rows[plain]["finish_reason"] in (
            "stop",
            "length",
        )
    assert _valid(json.loads(rows["resp-7"]["tool_calls"]))[0] == "get_weather"
    assert "tool_choice" in rows["chat-9"]["error"] and "nope" in rows["chat-9"]["error"]
    assert "response_format" in rows["chat-10"]["error"]

    # The export files: OpenAI's shapes, the same calls as the part's column.
    exported: dict[str, dict[str, Any]] = {}
    for name in names:
        if name.startswith(("openai-output-", "openai-errors-")):
            for text in s3_server.get(f"{spec.output.uri}{name}").decode().splitlines():
                line = json.loads(text)
                exported[line["custom_id"]] = line
    assert sorted(exported) == sorted(x["custom_id"] for x in lines)
    choice = exported["chat-4"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == json.loads(rows["chat-4"]["tool_calls"])
    assert "tool_calls" not in exported["chat-5"]["response"]["body"]["choices"][0]["message"]
    response = exported["resp-7"]["response"]["body"]
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather"
    assert calls[0]["call_id"] == json.loads(rows["resp-7"]["tool_calls"])[0]["id"]
    assert exported["chat-9"]["error"]["code"] == "invalid_request"


def _processor_config(model: Path, **prompt: Any) -> dict[str, Any]:
    return {
        "input": {"id_column": "qid", "messages_column": "chat"},
        "prompt": {"tools": TOOLS, **prompt},
        "model": {"path": str(model)},
        "engine": {"kind": "synthetic", "extra": {"script": SCRIPT, "ttft_ms": 1}},
        "sampling": {"max_tokens": 200, "overrides": {"tool_choice": "choice"}},
        "resources": {"cpus_per_actor": 0.25, "batch_size": 4},
    }


def test_processor_rows_parse_the_calls_the_model_wrote(
    ray_local: Any, tiny_model_dir: Path
) -> None:
    import ray.data

    from pipeline.data import build_processor

    rows = [
        {"qid": "auto", "chat": ASK, "choice": None},  # the job's tools, auto: parsed calls
        {"qid": "none", "chat": ASK, "choice": "none"},  # the row's own choice: no calls
        {"qid": "bad", "chat": ASK, "choice": json.dumps({"type": "function", "function": {}})},
    ]
    out = {
        r["qid"]: r
        for r in build_processor(_processor_config(tiny_model_dir))(
            ray.data.from_items(rows)
        ).take_all()
    }
    auto = out["auto"]
    assert auto["finish_reason"] == "tool_calls" and auto["text"] == "Let me check."
    calls = json.loads(auto["tool_calls"])
    assert _valid(calls) == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert out["none"]["tool_calls"] is None and out["none"]["text"] == SCRIPT
    assert out["bad"]["finish_reason"] == "error" and "'choice'" in out["bad"]["error"]

    # parallel_tool_calls false: the first call only. Call ids follow the row id, so a rerun
    # writes the same ids.
    single = build_processor(_processor_config(tiny_model_dir, parallel_tool_calls=False))
    (again,) = single(ray.data.from_items(rows[:1])).take_all()
    assert [c["id"] for c in json.loads(again["tool_calls"])] == [calls[0]["id"]]


def test_a_job_with_bad_tools_is_refused_before_any_actor(tiny_model_dir: Path) -> None:
    from pipeline.data import build_processor

    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    with pytest.raises(SpecError, match=r"prompt\.tools\[0\]\.function\.parameters"):
        build_processor(_processor_config(tiny_model_dir, tools=[broken]))
    with pytest.raises(SpecError, match=r"prompt\.tool_choice: .*'nope'"):
        build_processor(
            _processor_config(
                tiny_model_dir, tool_choice={"type": "function", "function": {"name": "nope"}}
            )
        )


# GPT-OSS: reasoning, then two calls as harmony messages to functions.NAME.
HARMONY_CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Paris", "unit": "celsius"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"city": "Rome"}<|call|>'
)


def test_processor_rows_read_harmony_calls(
    ray_local: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import ray.data

    from engines.dev.tiny import make_tiny_model
    from pipeline.data import build_processor

    model = Path(make_tiny_model(tmp_path_factory.mktemp("harmony") / "m", reasoning="harmony"))
    config = _processor_config(model, reasoning="harmony")
    config["engine"]["extra"]["script"] = HARMONY_CALLS
    (row,) = build_processor(config)(
        ray.data.from_items([{"qid": "a", "chat": ASK, "choice": None}])
    ).take_all()
    assert row["finish_reason"] == "tool_calls" and row["text"] == ""
    assert row["reasoning"] == "Need the weather."
    calls = json.loads(row["tool_calls"])
    assert _valid(calls) == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}
    # The same model without the harmony split cannot read them: refused by name per row.
    (refused,) = build_processor(_processor_config(model))(
        ray.data.from_items([{"qid": "b", "chat": ASK, "choice": None}])
    ).take_all()
    assert "prompt.reasoning: harmony" in refused["error"]
