"""ReferenceEngine behaviour: sampling, stops, per-request errors, streaming, abort, shutdown,
step records, load errors. One tiny Llama, engines shared per module where possible."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest

from engines.api import (
    EngineDeadError,
    EngineError,
    GenerationRequest,
    SamplingParams,
)
from engines.reference.engine import ReferenceEngine
from tests.engine_fixtures import run_all, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    eng = ReferenceEngine(str(tiny_model("llama")), num_threads=1, max_model_len=256)
    yield eng
    eng.shutdown()


def _req(prompt, rid=None, **sampling) -> GenerationRequest:
    kwargs = {"request_id": rid} if rid else {}
    return GenerationRequest(list(prompt), SamplingParams(**sampling), **kwargs)


PROMPT = [5, 17, 300, 42, 99, 7, 512, 8]


def test_info_describes_the_loaded_engine(engine) -> None:
    info = engine.info
    assert info.kind == "reference" and info.has_step_records
    assert info.max_model_len == 256 and info.device == "cpu" and info.dtype == "float32"
    assert info.num_devices == 1 and info.load_seconds > 0
    assert info.eos_token_ids == (2,)


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(engine) -> None:
    target = _req(PROMPT, "target", max_tokens=20, temperature=1.0, seed=77, ignore_eos=True)
    alone = run_all(engine, [target])[0]
    crowd = [
        _req(PROMPT[: i + 1] * 3, f"n{i}", max_tokens=15, temperature=0.9, ignore_eos=True)
        for i in range(6)
    ]
    crowd.insert(3, target)
    together = run_all(engine, crowd)[3]
    assert together.output_token_ids == alone.output_token_ids
    assert len(alone.output_token_ids) == 20
    other_seed = run_all(
        engine, [_req(PROMPT, max_tokens=20, temperature=1.0, seed=78, ignore_eos=True)]
    )[0]
    assert other_seed.output_token_ids != alone.output_token_ids


def test_per_request_errors_leave_the_others_running(engine) -> None:
    requests = [
        _req(PROMPT, "ok1", max_tokens=5, temperature=0.0, ignore_eos=True),
        _req(list(range(3, 3 + 300)), "too-long", max_tokens=5),
        _req([], "empty", max_tokens=5),
        _req([1, 2, 5000], "bad-id", max_tokens=5),
        _req(PROMPT, "ok2", max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    results = {r.request_id: r for r in run_all(engine, requests)}
    assert results["ok1"].finish_reason == results["ok2"].finish_reason == "length"
    assert results["ok1"].output_token_ids == results["ok2"].output_token_ids
    too_long = results["too-long"]
    assert too_long.finish_reason == "error" and not too_long.ok
    assert "300" in too_long.error and "256" in too_long.error
    assert "empty" in results["empty"].error
    assert "5000" in results["bad-id"].error and "vocabulary" in results["bad-id"].error
    assert all(r.metrics.finish_time is not None for r in results.values())


def test_request_that_cannot_fit_the_pool_fails_alone() -> None:
    eng = ReferenceEngine(
        str(tiny_model("llama")), num_threads=1, kv_cache_tokens=64, block_size=16
    )
    try:
        results = run_all(
            eng,
            [
                _req(PROMPT * 5, "big", max_tokens=40),
                _req(PROMPT, "small", max_tokens=3, ignore_eos=True),
            ],
        )
    finally:
        eng.shutdown()
    assert results[0].finish_reason == "error" and "KV blocks" in results[0].error
    assert results[1].finish_reason == "length"


def test_max_model_len_ends_with_length(engine) -> None:
    result = run_all(engine, [_req(list(range(3, 253)), max_tokens=50, ignore_eos=True)])[0]
    assert result.finish_reason == "length"
    assert result.completion_tokens == 256 - 250


def test_stop_token_ids_eos_and_stop_strings(engine) -> None:
    base = run_all(engine, [_req(PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True)])[0]
    ids, text = base.output_token_ids, base.text
    # A stop token id ends the request and stays in the ids.
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    r = run_all(
        engine,
        [_req(PROMPT, max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok], ignore_eos=True)],
    )[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop_tok
    assert r.output_token_ids == ids[: first + 1]
    # A stop string cuts the text before it.
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(needle)
    r = run_all(
        engine, [_req(PROMPT, max_tokens=30, temperature=0.0, stop=[needle], ignore_eos=True)]
    )[0]
    assert r.finish_reason == "stop" and r.stop_reason == needle
    assert r.text == text[:cut]
    assert r.output_token_ids == ids[: len(r.output_token_ids)]
    # EOS: token 2 ends the request unless ignore_eos.
    r = run_all(engine, [_req(PROMPT, max_tokens=30, temperature=0.0, stop_token_ids=[])])[0]
    if 2 in ids:
        assert r.finish_reason == "stop" and r.output_token_ids == ids[: ids.index(2) + 1]
    else:
        assert r.output_token_ids == ids


def test_stream_deltas_add_up_to_the_result(engine) -> None:
    async def main():
        deltas = []
        async for delta in engine.stream(
            _req(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
        ):
            deltas.append(delta)
        return deltas

    deltas = asyncio.run(main())
    final = deltas[-1]
    assert final.finished and final.result is not None
    assert [t for d in deltas for t in d.token_ids] == final.result.output_token_ids
    assert "".join(d.text for d in deltas) == final.result.text
    assert len(deltas) > 2  # tokens arrived as they were produced


def test_abort_and_closing_a_stream_cancel(engine) -> None:
    async def main():
        task = asyncio.create_task(
            engine.generate(_req(PROMPT, "long", max_tokens=200, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        engine.abort("long")
        aborted = await task
        stream = engine.stream(_req(PROMPT, "streamed", max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        return aborted

    aborted = asyncio.run(main())
    assert aborted.finish_reason == "cancelled"
    assert aborted.completion_tokens < 200
    deadline = 50
    while engine.stats().num_running and deadline:
        asyncio.run(asyncio.sleep(0.02))
        deadline -= 1
    assert engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0


def test_step_records_are_complete_before_results_arrive(engine) -> None:
    engine.drain_step_records()
    seen: list = []

    async def one(request):
        result = await engine.generate(request)
        seen.extend(engine.drain_step_records())
        decode = sum(rec.decode_tokens.get(request.request_id, 0) for rec in seen)
        prefill = sum(rec.prefill_tokens.get(request.request_id, 0) for rec in seen)
        return result, decode, prefill

    async def main():
        reqs = [
            _req(PROMPT[: i + 2] * 4, f"s{i}", max_tokens=3 + i, ignore_eos=True) for i in range(5)
        ]
        return await asyncio.gather(*(one(r) for r in reqs))

    for result, decode, prefill in asyncio.run(main()):
        assert decode == result.completion_tokens
        assert prefill == result.prompt_tokens - result.cached_prompt_tokens
    assert all(rec.end >= rec.start for rec in seen)


def test_shutdown_cancels_pending_and_refuses_new_requests() -> None:
    eng = ReferenceEngine(str(tiny_model("llama")), num_threads=1)

    async def main():
        tasks = [
            asyncio.create_task(eng.generate(_req(PROMPT, max_tokens=500, ignore_eos=True)))
            for _ in range(3)
        ]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.shutdown)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert {r.finish_reason for r in results} == {"cancelled"}
    eng.shutdown()  # idempotent
    with pytest.raises(EngineDeadError):
        run_all(eng, [_req(PROMPT)])


def test_unknown_setting_is_a_type_error_listing_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"max_num_tokns.*accepted: max_num_tokens"):
        ReferenceEngine(str(tiny_model("llama")), max_num_tokns=5)


def _copy_model(tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    model = _copy_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        ReferenceEngine(str(model), num_threads=1)


def test_missing_corrupt_and_misshapen_weights_are_named(tmp_path) -> None:
    model = _copy_model(tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match=r"model\.safetensors"):
        ReferenceEngine(str(model), num_threads=1)
    weights.unlink()
    with pytest.raises(EngineError, match=r"no model\.safetensors"):
        ReferenceEngine(str(model), num_threads=1)

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_model("llama") / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(EngineError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*missing"):
        ReferenceEngine(str(model), num_threads=1)

    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] += 1
    (model / "config.json").write_text(json.dumps(config))
    save_file(load_file(str(tiny_model("llama") / "model.safetensors")), str(weights))
    with pytest.raises(EngineError, match=r"gate_proj.weight.*shape"):
        ReferenceEngine(str(model), num_threads=1)


def test_invalid_sampling_values_are_value_errors() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_crashing_step_loop_fails_requests_with_engine_dead_error() -> None:
    eng = ReferenceEngine(str(tiny_model("llama")), num_threads=1)

    def broken(inputs):
        raise RuntimeError("simulated kernel failure")

    eng.runner.execute = broken
    try:
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            run_all(eng, [_req(PROMPT, max_tokens=3)])
        with pytest.raises(EngineDeadError):
            run_all(eng, [_req(PROMPT, max_tokens=3)])
    finally:
        eng.shutdown()


def test_the_model_loads_on_the_thread_that_runs_the_steps(monkeypatch) -> None:
    # One thread for both keeps one OpenMP pool in the process; with two, libgomp sleeps at
    # every barrier of a step (ReferenceEngine._engine_thread says why that is slow).
    import engines.reference.engine as engine_module
    import engines.reference.model.weights as weights

    loaded_on = []
    real = weights.load_model

    def spy(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", spy)
    eng = ReferenceEngine(str(tiny_model("llama")), num_threads=1)
    try:
        assert loaded_on == [eng._thread] and eng._thread is not threading.current_thread()
        assert run_all(eng, [_req(PROMPT, max_tokens=3, ignore_eos=True)])[0].ok
    finally:
        eng.shutdown()
