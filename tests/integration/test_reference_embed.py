"""Embeddings of the reference engine == transformers' pooled final hidden states (fp32), for
last-token and mean pooling with and without normalisation, batched with generation running
alongside; the checkpoint's sentence-transformers pooling is its default."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from engines.api import EmbedParams, GenerationRequest, SamplingParams
from engines.reference.engine import ReferenceEngine
from engines.reference.model.pooling import embed_defaults
from engines.reference.runtime.live import take_embed_batch
from tests.engine_fixtures import greedy_requests, hf_greedy, run_all, tiny_model, varied_prompts

pytestmark = pytest.mark.timeout(300)


def _hf_embeddings(model_dir: Path, prompts: list[list[int]], pooling: str, normalize: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][
                0
            ]  # [n, hidden], after the final norm
            vec = states[-1] if pooling == "last" else states.mean(0)
            out.append(torch.nn.functional.normalize(vec, dim=0) if normalize else vec)
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("pooling", "normalize"), [("last", True), ("mean", True), ("mean", False)]
)
def test_embeddings_match_transformers(arch: str, pooling: str, normalize: bool) -> None:
    model_dir = tiny_model(arch, arch == "qwen3")
    prompts = varied_prompts(12, seed=3)
    expected = _hf_embeddings(model_dir, prompts, pooling, normalize)
    # 64 tokens a forward: several prompts per batch and several batches.
    engine = ReferenceEngine(str(model_dir), num_threads=1, max_num_tokens=64, dtype="float32")
    try:
        params = EmbedParams(pooling=pooling, normalize=normalize)
        results = run_all(engine, [GenerationRequest(p, embed=params) for p in prompts])
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    assert all(r.ok and r.finish_reason == "stop" for r in results), [r.error for r in results]
    got = torch.tensor([r.embedding for r in results])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert [r.prompt_tokens for r in results] == [len(p) for p in prompts]
    assert all(r.completion_tokens == 0 and r.output_token_ids == [] for r in results)
    charged = {k: v for rec in records for k, v in rec.prefill_tokens.items()}
    assert charged == {r.request_id: r.prompt_tokens for r in results}
    assert len(records) < len(prompts)  # batched


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_gpt_oss_embeddings_keep_the_sliding_window(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-OSS's window layers see only the last `sliding_window` keys and every layer has its
    sinks: prompts longer than the tiny window, mean pooling so every row counts; through the
    paged kernel (CPU) and through the masked SDPA path (CUDA's, here with the kernels off)."""
    from engines.dev.tiny import GPT_OSS_TINY_WINDOW
    from engines.reference.model.cpu_kernels import DISABLE_ENV

    if kernels == "off":
        monkeypatch.setenv(DISABLE_ENV, "0")

    model_dir = tiny_model("gpt_oss")
    prompts = [p for p in varied_prompts(12, seed=4) if len(p) > 2 * GPT_OSS_TINY_WINDOW][:4]
    assert len(prompts) == 4
    expected = _hf_embeddings(model_dir, prompts, "mean", False)
    engine = ReferenceEngine(str(model_dir), num_threads=1, max_num_tokens=256, dtype="float32")
    try:
        params = EmbedParams(pooling="mean", normalize=False)
        results = run_all(engine, [GenerationRequest(p, embed=params) for p in prompts])
    finally:
        engine.shutdown()
    got = torch.tensor([r.embedding for r in results])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_embeddings_alongside_generation_leave_it_unchanged() -> None:
    model_dir = tiny_model("llama")
    gen = greedy_requests(varied_prompts(8, seed=5))
    expected = hf_greedy(model_dir, gen)
    prompts = varied_prompts(8, seed=6)
    engine = ReferenceEngine(str(model_dir), num_threads=1, max_num_tokens=48)
    try:
        embeds = [GenerationRequest(p, embed=EmbedParams()) for p in prompts]
        mixed = [x for pair in zip(gen, embeds, strict=True) for x in pair]
        results = run_all(engine, mixed, stagger_s=0.002)
        assert engine.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in results[0::2]] == expected
    default = _hf_embeddings(model_dir, prompts, "last", True)
    got = torch.tensor([r.embedding for r in results[1::2]])
    torch.testing.assert_close(got, default, atol=1e-5, rtol=1e-5)


def test_embed_row_errors() -> None:
    engine = ReferenceEngine(str(tiny_model("llama")), num_threads=1)
    try:
        too_long = [1] * (engine.max_model_len + 1)
        full = [1] * engine.max_model_len  # the whole context: fine, no output follows
        results = run_all(
            engine,
            [
                GenerationRequest([], embed=EmbedParams()),
                GenerationRequest([10**9], embed=EmbedParams()),
                GenerationRequest(too_long, embed=EmbedParams()),
                GenerationRequest(full, embed=EmbedParams(), sampling=SamplingParams()),
            ],
        )
    finally:
        engine.shutdown()
    assert [r.finish_reason for r in results] == ["error", "error", "error", "stop"]
    assert "empty" in results[0].error and "vocabulary" in results[1].error
    assert "max_model_len" in results[2].error


def test_embed_params_validated() -> None:
    with pytest.raises(ValueError, match="pooling"):
        EmbedParams(pooling="cls")  # type: ignore[arg-type]


def test_take_embed_batch_fits_token_budget() -> None:
    from collections import deque
    from types import SimpleNamespace

    def item(n: int) -> SimpleNamespace:
        return SimpleNamespace(request=SimpleNamespace(prompt_token_ids=[0] * n))

    queue = deque([item(30), item(30), item(50), item(200)])
    assert [len(e.request.prompt_token_ids) for e in take_embed_batch(queue, 64)] == [30, 30]
    assert [len(e.request.prompt_token_ids) for e in take_embed_batch(queue, 64)] == [50]
    assert [len(e.request.prompt_token_ids) for e in take_embed_batch(queue, 64)] == [200]
    assert not queue


def test_sentence_transformers_config_is_the_default(tmp_path: Path) -> None:
    model_dir = tmp_path / "st"
    shutil.copytree(tiny_model("llama"), model_dir)
    assert embed_defaults(model_dir).pooling == "last"
    (model_dir / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    defaults = embed_defaults(model_dir)
    assert (defaults.pooling, defaults.normalize) == ("mean", False)
    prompts = varied_prompts(3, seed=7)
    engine = ReferenceEngine(str(model_dir), num_threads=1, dtype="float32")
    try:
        results = run_all(engine, [GenerationRequest(p, embed=EmbedParams()) for p in prompts])
    finally:
        engine.shutdown()
    expected = _hf_embeddings(model_dir, prompts, "mean", False)
    torch.testing.assert_close(torch.tensor([r.embedding for r in results]), expected)


def test_embed_stream_delivers_one_final_delta() -> None:
    engine = ReferenceEngine(str(tiny_model("llama")), num_threads=1)

    async def main():
        return [d async for d in engine.stream(GenerationRequest([1, 2, 3], embed=EmbedParams()))]

    try:
        deltas = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].result.embedding


def test_a_crash_mid_embed_batch_fails_its_callers_and_reads_dead() -> None:
    """The forward of an embed batch raises (a device lost): the batch's callers get
    EngineDeadError (not a wait forever), and stats() says dead, not idle."""
    from engines.api import EngineDeadError

    model_dir = tiny_model("llama", False)
    engine = ReferenceEngine(str(model_dir), num_threads=1, max_num_tokens=64, dtype="float32")

    def lost(*args: object) -> None:
        raise RuntimeError("injected: the device fell off the bus")

    engine.runner.embed_hidden = lost  # type: ignore[method-assign]
    try:

        async def go() -> None:
            request = GenerationRequest([5, 6, 7], embed=EmbedParams(pooling="last"))
            with pytest.raises(EngineDeadError, match="fell off the bus"):
                await asyncio.wait_for(engine.generate(request), 30)

        asyncio.run(go())
        with pytest.raises(EngineDeadError, match="fell off the bus"):
            engine.stats()
    finally:
        engine.shutdown()
