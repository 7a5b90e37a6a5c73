"""LoRA adapters through the TensorRT-LLM adapter (stand-in written to 1.2's LoraConfig and
LoRARequest): the job's settings become the LLM's lora_config, a request's adapter goes as a
LoRARequest with a stable id, and what cannot run is that request's error, named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.api import EngineError, GenerationRequest
from tests.unit.test_trtllm import engine_for, greedy, model_dir, run, trt  # noqa: F401


def adapter(folder: Path, rank: int = 8) -> str:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def toy(prompt: list[int], n: int, adapter_id: int = 0) -> list[int]:
    """The stand-in's greedy tokens, shifted per adapter id (tensorrt_llm/_core.py)."""
    return [(sum(prompt) + 7 * i + 13 * adapter_id) % 50 + 10 for i in range(n)]


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    return {"zeta": adapter(tmp_path / "z"), "alpha": adapter(tmp_path / "a", rank=16)}


def test_settings_become_lora_config_and_requests_carry_their_adapter(
    trt,  # noqa: F811
    model_dir,  # noqa: F811
    adapters,
) -> None:
    from tensorrt_llm.executor import LoRARequest
    from tensorrt_llm.lora_helper import LoraConfig

    engine = engine_for(model_dir, lora_adapters=adapters, max_loras=2, max_lora_rank=16)
    llm = trt.LLM.instances[-1]
    # Ids follow the sorted names: alpha 1, zeta 2, whatever the map's order.
    assert llm.args["lora_config"] == LoraConfig(
        lora_dir=[adapters["alpha"], adapters["zeta"]],
        max_lora_rank=16,
        max_loras=2,
        max_cpu_loras=8,
    )
    prompt = [11, 12, 13]
    names = [None, "alpha", "zeta"]
    results = run(_all(engine, [GenerationRequest(prompt, greedy(4), adapter=n) for n in names]))
    assert [r.output_token_ids for r in results] == [toy(prompt, 4, i) for i in range(3)]
    assert llm.lora_requests == [
        None,
        LoRARequest("alpha", 1, adapters["alpha"]),
        LoRARequest("zeta", 2, adapters["zeta"]),
    ]
    engine.shutdown()


def test_what_cannot_run_is_the_requests_error_naming_it(
    trt,  # noqa: F811
    model_dir,  # noqa: F811
    adapters,
    tmp_path: Path,
) -> None:
    high = adapter(tmp_path / "high", rank=32)
    engine = engine_for(model_dir, lora_adapters={**adapters, "high": high}, max_lora_rank=16)
    unknown, over = run(
        _all(
            engine,
            [
                GenerationRequest([5, 6], greedy(2), adapter="nope"),
                GenerationRequest([5, 6], greedy(2), adapter="high"),
            ],
        )
    )
    assert unknown.finish_reason == "error" and "'nope'" in unknown.error
    assert "alpha, high, zeta" in unknown.error
    assert over.finish_reason == "error" and "'high'" in over.error
    assert "r 32 is over the engine's max_lora_rank 16" in over.error
    # Nothing of either reached the executor.
    assert trt.LLM.instances[-1].submitted == []
    engine.shutdown()
    # An engine without adapters never answers one with its base model.
    plain = engine_for(model_dir)
    result = run(plain.generate(GenerationRequest([5, 6], greedy(2), adapter="alpha")))
    assert result.finish_reason == "error" and "does not run adapters" in result.error
    assert trt.LLM.instances[-1].args["lora_config"] is None
    plain.shutdown()


def test_the_tensorrt_backend_refuses_adapters(trt, model_dir, adapters) -> None:  # noqa: F811
    with pytest.raises(EngineError, match="pytorch backend"):
        engine_for(model_dir, backend="tensorrt", lora_adapters=adapters)


async def _all(engine, requests):
    import asyncio

    return await asyncio.gather(*(engine.generate(r) for r in requests))
