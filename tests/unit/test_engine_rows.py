"""The engine actor's work per row: sampling params shared through a cache, and request ids
unique without a uuid per row (pipeline.batch.stages.rows.row_sampling, RowServer in the engine
actor)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pipeline.batch.stages.rows import SAMPLING_CACHE_SIZE, GenerateConfig, row_sampling
from pipeline.spec import SamplingSpec, parse_job_spec

ROWS: list[dict[str, Any]] = [
    {"id": "a", "max_tokens": 4, "temperature": None, "top_p": 0.5, "seed": 7},
    {"id": "b", "max_tokens": 4, "temperature": None, "top_p": 0.5, "seed": 7},
    {"id": "c", "max_tokens": 4, "temperature": 0.0, "top_p": 0.5, "seed": 7},
    {"id": "d", "max_tokens": 5, "top_k": 3, "logprobs": 2, "num_samples": 2},
    {"id": "e", "response_format": '{"type": "json_object"}', "logprobs": None},
    {"id": "f"},  # no seed column (no prompt stage): derived from (sampling.seed, id)
    {"id": "g"},
]


def test_cached_params_equal_fresh_ones_and_are_shared() -> None:
    sampling = SamplingSpec(max_tokens=9, temperature=0.3, stop=["\n\n"], seed=5)
    cache: dict = {}
    cached = [row_sampling(row, sampling, cache) for row in ROWS]
    assert cached == [row_sampling(row, sampling) for row in ROWS]
    assert cached[0] is cached[1]  # the same values: one object
    assert cached[2] is not cached[0] and cached[2].temperature == 0.0
    assert cached[5].seed != cached[6].seed  # derived per row, never shared across ids
    assert len(cache) == len(ROWS) - 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"id": "x", "top_p": 1.5}, "top_p must be in"),
        ({"id": "x", "temperature": float("nan")}, "temperature must be a number"),
        ({"id": "x", "logprobs": 99}, "logprobs must be null or an integer"),
    ],
)
def test_invalid_rows_raise_every_time(row: dict[str, Any], message: str) -> None:
    sampling, cache = SamplingSpec(), {}
    for _ in range(2):  # an invalid row is never cached
        with pytest.raises(ValueError, match=message):
            row_sampling(row, sampling, cache)
    assert cache == {}


def test_the_cache_stays_bounded() -> None:
    sampling, cache = SamplingSpec(), {}
    for seed in range(SAMPLING_CACHE_SIZE + 10):
        assert row_sampling({"id": "x", "seed": seed}, sampling, cache).seed == seed
    assert len(cache) <= SAMPLING_CACHE_SIZE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the synthetic engine reads of a model: config.json and the tokenizer."""
    from engines.dev.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("engine-rows-model")
    tokenizer = train_tokenizer(512)
    tokenizer.save_pretrained(out)
    config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_request_ids_are_unique_with_repeated_row_ids(model_dir: Path, tmp_path: Path) -> None:
    from pipeline.batch.commit.parts import PartWritten, read_part
    from pipeline.batch.stages.generate import EngineWorker
    from pipeline.batch.stages.schema import output_schema
    from pipeline.batch.units import RowSelection, Shard, WorkUnit

    spec = parse_job_spec(
        {
            "name": "rows",
            "input": {"uri": "/in.jsonl", "format": "jsonl", "prompt_column": "q"},
            "model": {"path": str(model_dir)},
            "engine": {"kind": "synthetic", "extra": {"ttft_ms": 0, "step_interval_ms": 1}},
            "output": {"uri": str(tmp_path / "out")},
            "sampling": {"max_tokens": 2, "n": 2},
        }
    )
    worker = EngineWorker(GenerateConfig.from_spec(spec, output_schema()))
    seen: list[str] = []
    generate = worker.engine.generate

    async def spy(request: Any) -> Any:
        seen.append(request.request_id)
        return await generate(request)

    worker.engine.generate = spy  # type: ignore[method-assign]
    rows = pa.Table.from_pylist(
        [
            {"_row": i, "id": "same", "prompt_token_ids": [5, 6, 7 + i], "error": None}
            for i in range(6)
        ]
    )

    async def run() -> list[Any]:
        unit = WorkUnit(
            Shard(0, "unused.jsonl", 0, "", "byte_range", 0, 0),
            run=1,
            dispatch=1,
            selection=RowSelection(),
        )
        return [event async for event in worker.run_unit(unit, rows)]

    events = asyncio.run(run())
    worker.engine.shutdown()
    assert len(seen) == 12 == len(set(seen))  # 6 rows x n=2 samples
    assert all(rid.startswith(f"same#{worker.incarnation[:8]}.") for rid in seen)
    parts = [read_part(worker.out, e.record.name) for e in events if isinstance(e, PartWritten)]
    finished = pa.concat_tables(parts).column("finish_reason").to_pylist()
    assert finished == ["length"] * 6


def test_collector_settings_apply_only_inside_an_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import pipeline.batch.stages.heap as heap

    before = gc.get_threshold()
    heap.settle_after_load()  # a test process is no actor: nothing changes
    assert gc.get_threshold() == before
    monkeypatch.setattr(heap, "_in_actor", lambda: True)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # keep this process's heap collectable
    try:
        heap.settle_after_load()
        assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    finally:
        gc.set_threshold(*before)
