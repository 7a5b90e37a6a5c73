"""LoRA adapters in a batch job, on a local Ray with the S3 server: rows pick their adapter by
a column (openai_batch lines by body.model), one adapter comes from an s3:// prefix, rows of an
unknown adapter are error rows naming it, every id is committed once, each row's text is what
the engine gives that row's prompt under that adapter, and the manifest and report total
tokens and dollars per adapter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipeline.batch.driver.run import run_job
from pipeline.storage import OutputDir
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import (
    _merge,
    assert_exactly_once,
    assert_totals_match,
    make_spec,
    manifest_of,
    read_output,
)

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["Write about the rivers.", "Name three bridges.", "What is a harbour?"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from engines.dev.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("job-adapters")
    return {
        "qv": make_lora_adapter(root / "qv", tiny_model_dir, rank=8, seed=1),
        "mlp": make_lora_adapter(
            root / "mlp", tiny_model_dir, rank=4, targets=("gate_proj", "down_proj"), seed=2
        ),
    }


def with_adapters(spec: Any, adapters: dict[str, str], column: str | None = None) -> Any:
    """`spec` (test_pipeline.make_spec's) with model.adapters (and input.adapter_column)."""
    from pipeline.spec import parse_job_spec

    data = spec.model_dump(mode="json", exclude_unset=True)
    extra: dict[str, Any] = {"model": {"adapters": adapters}}
    if column is not None:
        extra["input"] = {"adapter_column": column}
    return parse_job_spec(_merge(data, extra))


def engine_texts(spec: Any, rows: list[dict[str, Any]], sources: dict[str, str]) -> list[str]:
    """What the reference engine answers each row's rendered prompt under its adapter."""
    from engines.api import GenerationRequest, SamplingParams
    from engines.reference.engine import ReferenceEngine
    from pipeline.batch.stages.prompts import render_row
    from pipeline.openai.chat import load_tokenizer

    tokenizer = load_tokenizer(spec.model, spec.storage)
    engine = ReferenceEngine(
        spec.model.path, lora_adapters=sources, num_threads=1, max_model_len=512
    )
    sampling = SamplingParams(max_tokens=6, temperature=0.0)

    async def go() -> list[str]:
        requests = [
            GenerationRequest(
                render_row({"prompt": r["text"]}, spec, tokenizer),
                sampling,
                adapter=r.get("adapter") or None,
            )
            for r in rows
        ]
        return [x.text for x in await asyncio.gather(*(engine.generate(q) for q in requests))]

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


def test_rows_pick_adapters_and_the_report_totals_each(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, adapter_dirs: dict
) -> None:
    bucket = s3_server.make_bucket()
    s3_server.upload_dir(adapter_dirs["mlp"], f"s3://{bucket}/adapters/mlp")
    rows = []
    for i, text in enumerate(PROMPTS):
        for adapter in ("qv", "mlp", None, ""):
            rows.append({"id": f"{adapter or 'base'}-{i}-{len(rows)}", "text": text, "ad": adapter})
    rows.append({"id": "unknown", "text": PROMPTS[0], "ad": "nope"})
    uri = f"s3://{bucket}/in/rows.jsonl"
    s3_server.put(uri, "".join(json.dumps(r) + "\n" for r in rows))
    source = {"uri": uri, "format": "jsonl", "id_column": "id", "prompt_column": "text"}
    adapters = {"qv": str(adapter_dirs["qv"]), "mlp": f"s3://{bucket}/adapters/mlp"}
    spec = with_adapters(
        make_spec(
            "lora-job",
            source,
            f"s3://{bucket}/out/",
            s3_server,
            tiny_model_dir,
            engine={"max_model_len": 512, "max_loras": 2},
            limits={"max_error_fraction": 0.2},
        ),
        adapters,
        column="ad",
    )
    result = run_job(spec)
    assert result.status == "complete", result.message
    table, _ = read_output(s3_server, f"s3://{bucket}/out/")
    assert_exactly_once(table, [r["id"] for r in rows])
    by_id = {r["id"]: r for r in table.to_pylist()}
    unknown = by_id.pop("unknown")
    assert "unknown adapter 'nope'" in unknown["error"] and "mlp, qv" in unknown["error"]
    assert unknown["adapter"] == "nope"
    assert all(r["error"] is None for r in by_id.values())
    for r in rows[:-1]:
        assert by_id[r["id"]]["adapter"] == (r["ad"] or None)
    # Each row's text is the engine's for its prompt under its adapter (the s3 one included).
    local = {**adapters, "mlp": str(adapter_dirs["mlp"])}
    expected = engine_texts(
        spec, [{"text": r["text"], "adapter": r["ad"]} for r in rows[:-1]], local
    )
    assert [by_id[r["id"]]["text"] for r in rows[:-1]] == expected
    assert len({by_id[f"{a}-0-{k}"]["text"] for a, k in (("qv", 0), ("mlp", 1), ("base", 2))}) > 1
    # Per adapter in the manifest and the report: the rows' own sums.
    manifest = manifest_of(s3_server, f"s3://{bucket}/out/")
    assert_totals_match(manifest, table)
    per = manifest["stats"]["by_adapter"]
    assert set(per) == {"", "qv", "mlp", "nope"}
    for name in ("qv", "mlp"):
        mine = table.filter(pa.compute.equal(table.column("adapter"), name))
        assert per[name]["rows"] == mine.num_rows == len(PROMPTS)
        assert per[name]["completion_tokens"] == pa.compute.sum(mine["completion_tokens"]).as_py()
        assert per[name]["cost_usd"] == pytest.approx(pa.compute.sum(mine["cost_usd"]).as_py())
    assert per[""]["rows"] == 2 * len(PROMPTS) and per["nope"]["errors"] == 1
    from pipeline.report import write_report  # what `tokenmill run` writes after the run

    write_report(f"s3://{bucket}/out", spec.storage)
    report = OutputDir(f"s3://{bucket}/out", spec.storage).read("report.md").decode()
    assert "### By adapter" in report and "| qv |" in report and "(model)" in report


def test_openai_batch_lines_pick_adapters_by_body_model(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, adapter_dirs: dict
) -> None:
    bucket = s3_server.make_bucket()

    def line(i: int, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPTS[0]}]}
        if model is not None:
            body["model"] = model
        return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    models = ["tiny", "qv", None, "qv", "other-model"]
    lines = [line(i, m) for i, m in enumerate(models)]
    uri = f"s3://{bucket}/in/batch.jsonl"
    s3_server.put(uri, "".join(json.dumps(x) + "\n" for x in lines))
    spec = with_adapters(
        make_spec(
            "lora-batch",
            {"uri": uri, "format": "openai_batch"},
            f"s3://{bucket}/out/",
            s3_server,
            tiny_model_dir,
            limits={"max_error_fraction": 0.5},
        ),
        {"qv": str(adapter_dirs["qv"])},
    )
    result = run_job(spec)
    assert result.status == "complete"
    table, _ = read_output(s3_server, f"s3://{bucket}/out/")
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert [by_id[f"c{i}"]["adapter"] for i in range(4)] == [None, "qv", None, "qv"]
    assert all(by_id[f"c{i}"]["error"] is None for i in range(4))
    bad = by_id["c4"]["error"]
    assert "body.model 'other-model'" in bad and "'tiny'" in bad and "qv" in bad
    # One prompt throughout: the base lines agree, the adapter's agree, and the two differ.
    assert by_id["c0"]["text"] == by_id["c2"]["text"]
    assert by_id["c1"]["text"] == by_id["c3"]["text"] != by_id["c0"]["text"]


def test_adapters_found_under_a_prefix_on_first_use(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path, adapter_dirs: dict, tmp_path: Path
) -> None:
    """model.adapter_prefix on the S3 server, no model.adapters: each name a row gives is
    fetched from PREFIX/NAME when it first runs; a name with nothing there, or no folder name
    at all, is that row's error naming it and the prefix."""
    from pipeline.spec import parse_job_spec

    bucket = s3_server.make_bucket()
    for name, folder in adapter_dirs.items():
        s3_server.upload_dir(folder, f"s3://{bucket}/library/{name}")
    names = ["qv", "mlp", None, "qv", "missing", "../qv"]
    rows = [{"id": f"r{i}", "text": PROMPTS[i % 3], "ad": n} for i, n in enumerate(names)]
    uri = f"s3://{bucket}/in/rows.jsonl"
    s3_server.put(uri, "".join(json.dumps(r) + "\n" for r in rows))
    source = {"uri": uri, "format": "jsonl", "id_column": "id", "prompt_column": "text"}
    base = make_spec(
        "lora-prefix",
        source,
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        engine={"max_model_len": 512},
        limits={"max_error_fraction": 0.5},
    )
    extra = {
        "model": {"adapter_prefix": f"s3://{bucket}/library", "cache_dir": str(tmp_path)},
        "input": {"adapter_column": "ad"},
    }
    spec = parse_job_spec(_merge(base.model_dump(mode="json", exclude_unset=True), extra))
    result = run_job(spec)
    assert result.status == "complete", result.message
    table, _ = read_output(s3_server, f"s3://{bucket}/out/")
    assert_exactly_once(table, [r["id"] for r in rows])
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert "unknown adapter 'missing'" in by_id["r4"]["error"]
    assert f"s3://{bucket}/library/missing" in by_id["r4"]["error"]
    assert "unknown adapter '../qv'" in by_id["r5"]["error"]
    ok = rows[:4]
    assert all(by_id[r["id"]]["error"] is None for r in ok)
    expected = engine_texts(
        spec,
        [{"text": r["text"], "adapter": r["ad"]} for r in ok],
        {n: str(f) for n, f in adapter_dirs.items()},
    )
    assert [by_id[r["id"]]["text"] for r in ok] == expected
    assert [by_id[r["id"]]["adapter"] for r in ok] == ["qv", "mlp", None, "qv"]
    # Fetched once per node, into model.cache_dir.
    fetched = sorted(p.parent.name for p in tmp_path.rglob("adapter_config.json"))
    assert fetched == ["mlp", "qv"]


def test_adapters_need_an_engine_and_a_column_that_take_them(tiny_model_dir: Path) -> None:
    from pipeline.spec import parse_job_spec

    base = {
        "name": "x",
        "input": {"uri": "in.jsonl", "format": "jsonl", "prompt_column": "p"},
        "model": {"path": str(tiny_model_dir), "name": "tiny", "adapters": {"a": "/x"}},
        "output": {"uri": "/tmp/out"},
    }
    with pytest.raises(ValueError, match=r"input\.adapter_column"):
        parse_job_spec(base)
    with pytest.raises(ValueError, match=r"engine\.kind synthetic runs no model"):
        parse_job_spec(
            {
                **base,
                "engine": {"kind": "synthetic"},
                "input": {**base["input"], "adapter_column": "a"},
            }
        )
    for kind in ("vllm", "trtllm"):  # they pass adapters to their own LoRA APIs
        spec = parse_job_spec(
            {**base, "engine": {"kind": kind}, "input": {**base["input"], "adapter_column": "a"}}
        )
        assert spec.model.adapters == {"a": "/x"}
    with pytest.raises(ValueError, match="model's own name"):
        parse_job_spec(
            {
                **base,
                "model": {**base["model"], "adapters": {"tiny": "/x"}},
                "input": {**base["input"], "adapter_column": "a"},
            }
        )
    with pytest.raises(ValueError, match=r"model\.adapters is empty"):
        parse_job_spec(
            {
                **base,
                "model": {"path": str(tiny_model_dir)},
                "input": {**base["input"], "adapter_column": "a"},
            }
        )


def test_the_dataset_processor_takes_the_same_adapters(
    ray_local: Any, tiny_model_dir: Path, adapter_dirs: dict
) -> None:
    """build_processor with model.adapters and input.adapter_column: each row's text is what
    the engine answers under the row's adapter, and rows carry `adapter`."""
    import ray.data

    from pipeline.data import build_processor

    processor = build_processor(
        {
            "input": {"id_column": "k", "prompt_column": "q", "adapter_column": "who"},
            "model": {
                "path": str(tiny_model_dir),
                "name": "tiny",
                "adapters": {"qv": str(adapter_dirs["qv"])},
            },
            "engine": {"kind": "reference", "device": "cpu", "max_model_len": 512},
            "sampling": {"max_tokens": 6, "temperature": 0.0},
            "resources": {"cpus_per_actor": 0.25, "batch_size": 4},
        }
    )
    items = [{"k": f"r{i}", "q": PROMPTS[i % 2], "who": ["qv", None][i // 2]} for i in range(4)]
    rows = {r["id"]: r for r in processor(ray.data.from_items(items)).take_all()}
    spec = processor.config.job_spec()
    want = engine_texts(
        spec,
        [{"text": x["q"], "adapter": x["who"]} for x in items],
        {"qv": str(adapter_dirs["qv"])},
    )
    assert [rows[x["k"]]["text"] for x in items] == want
    assert [rows[x["k"]]["adapter"] for x in items] == ["qv", "qv", None, None]
