"""Read + prompt stage on a local Ray prompt actor, with inputs and the model on S3 (moto over
HTTP); and `tokenmill plan` over the same input without Ray."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.batch.columns import PROMPT_TOKEN_IDS, PROMPT_TOKENS, TOO_LONG
from pipeline.batch.driver.cluster import start_prompters
from pipeline.batch.driver.plan import build_plan, preflight
from pipeline.batch.driver.run import plan_input
from pipeline.batch.units import RowSelection, WorkUnit
from pipeline.spec import parse_job_spec
from tests.integration.s3_server import S3Server


def test_tokenize_s3_inputs_with_s3_model(
    ray_local, s3_server: S3Server, bucket: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_uri = f"s3://{bucket}/models/tiny"
    s3_server.upload_dir(tiny_model_dir, model_uri)
    lines = [{"rid": f"r{i}", "q": f"Tell me about the river {i}", "mt": 4 + i} for i in range(9)]
    lines.append({"rid": "long", "q": "river " * 3000, "mt": 8})
    lines.append({"rid": "empty", "q": "", "mt": 8})
    s3_server.put(f"s3://{bucket}/in/a.jsonl", "\n".join(json.dumps(x) for x in lines))
    spec = parse_job_spec(
        {
            "name": "tokenize-s3",
            "input": {
                "uri": f"s3://{bucket}/in/",
                "format": "jsonl",
                "id_column": "rid",
                "prompt_column": "q",
            },
            "prompt": {"system_prompt": "Answer briefly."},
            "model": {"path": model_uri, "cache_dir": str(tmp_path / "cache")},
            "output": {"uri": f"s3://{bucket}/out/"},
            "sampling": {"max_tokens": 16, "seed": 3, "overrides": {"max_tokens": "mt"}},
            "storage": s3_server.storage_spec().model_dump(),
            "resources": {"batch_size": 4},
        }
    )
    files = preflight(spec)
    plan, passthrough = plan_input(spec, files)
    (prompter,) = start_prompters(spec, passthrough).handles
    rows = []
    for shard in plan.shards:
        unit = WorkUnit(shard, run=1, dispatch=1, selection=RowSelection())
        info_ref, rows_ref = prompter.prepare.options(num_returns=2).remote(unit)
        info = ray_local.get(info_ref)
        assert info.num_rows == info.num_selected
        rows += ray_local.get(rows_ref).to_pylist()

    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {*(f"r{i}" for i in range(9)), "long", "empty"}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for i in range(9):
        row = by_id[f"r{i}"]
        assert row["error"] is None
        assert row["max_tokens"] == 4 + i
        assert row[PROMPT_TOKENS] == len(row[PROMPT_TOKEN_IDS]) > 0
        text = tokenizer.decode(row[PROMPT_TOKEN_IDS])
        assert "Answer briefly." in text and f"Tell me about the river {i}" in text
    seeds = {by_id[f"r{i}"]["seed"] for i in range(9)}
    assert len(seeds) == 9 and None not in seeds
    assert by_id["long"]["error"].startswith(TOO_LONG)
    assert "context length 2048" in by_id["long"]["error"]
    assert by_id["empty"]["error"] == "empty prompt"

    # The plan sees the same rows without Ray: counts, errors, token totals.
    plan = build_plan(spec, files=files, tokens_per_s=50.0)
    assert plan.num_rows == 11 and plan.sample_rows == 11
    assert plan.sample_errors == 2 and plan.sample_too_long == 1
    assert plan.est_prompt_tokens == sum(by_id[f"r{i}"][PROMPT_TOKENS] for i in range(9))
    assert plan.est_output_tokens_max == sum(4 + i for i in range(9))
    assert plan.est_wall_s == plan.est_output_tokens_max / 50.0
