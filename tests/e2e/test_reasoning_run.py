"""Reasoning output through `tokenmill run` (a subprocess with its own local Ray, local files):
the synthetic engine, scripted to write a known reasoning block and answer in the tiny think
model's tokens, so the split and the token counts are known exactly.

The model's template opens the `<think>` block in the prompt (Qwen3-thinking style), so the
output is reasoning from its first token up to `</think>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.e2e.test_run import committed, tokenmill, write_job

pytestmark = pytest.mark.timeout(400)

REASONING = "the river runs north"
ANSWER = "It is cold."
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("model") / "think", reasoning="think"))


@pytest.fixture(scope="module")
def counts(think_model: Path) -> dict[str, int]:
    """Token counts of the script, from the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(think_model))
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("</think>")
    return {"reasoning": ids.index(end), "completion": len(ids) + 1}  # + the EOS token


def job(tmp_path: Path, model: Path, source: Path, **sections: Any) -> dict[str, Any]:
    return {
        "name": "reasoning",
        "model": {"path": str(model)},
        "engine": {
            "kind": "synthetic",
            "extra": {"script": SCRIPT, "ttft_ms": 1, "ttft_jitter": 0.0},
        },
        "prompt": {"reasoning": "think"},
        "sampling": {"max_tokens": 64},
        "resources": {"num_actors": 1, "cpus_per_actor": 0.25, "batch_size": 4},
        "output": {"uri": str(tmp_path / "out"), "report": False},
        **sections,
    }


def test_run_splits_reasoning_and_counts_its_tokens(
    tmp_path: Path, think_model: Path, counts: dict[str, int]
) -> None:
    rows = [
        {"id": "plain", "q": "Why is the river cold?"},
        {"id": "effort", "q": "Why is the river cold?", "effort": "high"},
        {"id": "cut", "q": "Why is the river cold?", "mt": 3},  # ends inside the block
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = job(
        tmp_path,
        think_model,
        source,
        input={"uri": str(source), "format": "jsonl", "id_column": "id", "prompt_column": "q"},
    )
    spec["sampling"]["overrides"] = {"reasoning_effort": "effort", "max_tokens": "mt"}
    proc = tokenmill("run", str(write_job(tmp_path / "job.yaml", spec)), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {r["id"]: r for r in committed(tmp_path / "out").to_pylist()}
    assert set(out) == {"plain", "effort", "cut"}
    for name in ("plain", "effort"):
        row = out[name]
        assert (row["reasoning"], row["text"]) == (REASONING, ANSWER)
        assert row["reasoning_tokens"] == counts["reasoning"]
        assert row["completion_tokens"] == counts["completion"]  # tokens are tokens
        assert row["finish_reason"] == "stop"
    # The row's effort reached the chat template (its system turn): a longer prompt.
    assert out["effort"]["prompt_tokens"] > out["plain"]["prompt_tokens"]
    cut = out["cut"]
    assert (cut["reasoning"], cut["text"], cut["finish_reason"]) == ("the river", "", "length")
    assert cut["reasoning_tokens"] == cut["completion_tokens"] == 3
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    assert schema.field("reasoning_tokens").type == "int32"


def test_openai_batch_lines_carry_reasoning(
    tmp_path: Path, think_model: Path, counts: dict[str, int]
) -> None:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "think",
                "messages": [{"role": "user", "content": "Why is the river cold?"}],
                "n": n,
                "temperature": 1.0 if n > 1 else 0.0,
            },
        }
        for i, n in enumerate((1, 2, 1))
    ]
    lines[2]["body"]["reasoning_effort"] = "high"  # reaches the chat template
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = job(
        tmp_path,
        think_model,
        source,
        input={"uri": str(source), "format": "openai_batch", "passthrough_columns": ["url"]},
    )
    spec["output"]["format"] = "openai_batch"
    proc = tokenmill("run", str(write_job(tmp_path / "job.yaml", spec)), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answered = {}
    for path in sorted((tmp_path / "out").glob("openai-output-*.jsonl")):
        for text in path.read_text().splitlines():
            line = json.loads(text)
            answered[line["custom_id"]] = line["response"]["body"]
    assert set(answered) == {"req-0", "req-1", "req-2"}
    usage = {k: body["usage"] for k, body in answered.items()}
    assert usage["req-2"]["prompt_tokens"] > usage["req-0"]["prompt_tokens"]
    for custom_id, choices in (("req-0", 1), ("req-1", 2), ("req-2", 1)):
        body = answered[custom_id]
        assert len(body["choices"]) == choices
        for choice in body["choices"]:
            assert choice["message"]["content"] == ANSWER
            assert choice["message"]["reasoning_content"] == REASONING
        usage = body["usage"]
        assert (
            usage["completion_tokens_details"]["reasoning_tokens"] == choices * counts["reasoning"]
        )
        assert usage["completion_tokens"] == choices * counts["completion"]
