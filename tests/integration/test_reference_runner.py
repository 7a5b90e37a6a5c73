"""ModelRunner's attention paths and thread choice: chunks with history (a speculative
verification's 1 + k tokens, a decode token, a short prefill) attend through the CPU paged
kernel (which takes every chunk of a step) or, as on CUDA, in decode groups, and both must give
the logits the per-request prefill path gives; small steps run on one thread and leave the
thread count as it was."""

from __future__ import annotations

import pytest
import torch

import engines.reference.runtime.runner as runner_module
from engines.reference.model.config import load_model_config
from engines.reference.model.cpu_kernels import kernels_available
from engines.reference.model.weights import load_model
from engines.reference.runtime.runner import ChunkInput, ModelRunner, intra_op_threads
from engines.reference.runtime.scheduler import ScheduledChunk
from tests.engine_fixtures import tiny_model

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16


def _runner(arch: str) -> ModelRunner:
    model_dir = tiny_model(arch)
    cfg = load_model_config(model_dir)
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    return ModelRunner(model, cfg, 64, BLOCK_SIZE, 512, torch.float32, torch.device("cpu"))


def _tables(lengths: list[int]) -> list[list[int]]:
    """Disjoint block tables, block 0 left out (padding points there)."""
    tables, next_block = [], 1
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


@pytest.mark.parametrize("path", ["kernel", "groups"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])  # gpt_oss: sinks, window 8
def test_short_chunks_match_the_prefill_path(arch, path, monkeypatch) -> None:
    runner = _runner(arch)
    if path == "kernel" and not kernels_available():
        pytest.skip("no C++ compiler for the paged kernel")
    runner._paged_kernel = path == "kernel"
    gen = torch.Generator().manual_seed(0)
    # (history, chunk tokens, proposals): verification chunks of several sizes, a plain decode
    # token and a short chunk with no history, in one step.
    shapes = [(37, 5, 4), (20, 5, 4), (64, 3, 2), (50, 1, 0), (0, 6, 0), (15, 8, 7)]
    lengths = [history + n for history, n, _ in shapes]
    tables = _tables(lengths)
    tokens = [torch.randint(3, 1000, (length,), generator=gen).tolist() for length in lengths]
    history = [
        ChunkInput(ScheduledChunk(f"r{i}", 0, h, True, h), tokens[i], tables[i])
        for i, (h, _, _) in enumerate(shapes)
        if h > 0
    ]
    runner.execute(history)  # the cached context every chunk attends to
    step = []
    for i, (h, n, k) in enumerate(shapes):
        spec = tuple(tokens[i][h + n - k : h + n])
        own = tokens[i][: h + n - k]  # the request's real tokens; proposals come on top
        step.append(ChunkInput(ScheduledChunk(f"r{i}", h, n, True, n - k, spec), own, tables[i]))

    grouped = runner.execute(step)
    batch = runner.prepare(step).batch
    assert len(batch.prefills) == 0  # every chunk went through the kernel or a group
    assert (batch.paged is not None) == (path == "kernel")
    assert (len(batch.decode_groups) == 0) == (path == "kernel")
    if path == "kernel":  # the kernel takes every chunk: its rows are all of the step's
        assert batch.paged.rows.tolist() == list(range(sum(n for _, n, _ in shapes)))
    runner._paged_kernel = False
    monkeypatch.setattr(runner_module, "_MAX_GROUPED_QUERIES", 0)
    batch = runner.prepare(step).batch
    assert len(batch.decode_groups) == 0 and batch.paged is None
    assert len(batch.prefills) == len(shapes)
    per_request = runner.execute(step)

    assert grouped.shape == (sum(k + 1 for _, _, k in shapes), runner.model.config.vocab_size)
    torch.testing.assert_close(grouped, per_request, rtol=1e-5, atol=1e-5)
    assert grouped.argmax(-1).tolist() == per_request.argmax(-1).tolist()


# llama: fused RoPE + cache write; qwen3: q/k norms; gpt_oss: sinks and a window of 8 keys.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_prefill_chunks_through_the_kernel_match_the_prefill_path(arch) -> None:
    runner = _runner(arch)
    if not kernels_available():
        pytest.skip("no C++ compiler for the paged kernel")
    gen = torch.Generator().manual_seed(1)
    # (history, chunk tokens): a fresh prompt, a chunk continuing a cached prompt, a decode.
    shapes = [(0, 40), (30, 24), (50, 1)]
    lengths = [history + n for history, n in shapes]
    tables = _tables(lengths)
    tokens = [torch.randint(3, 1000, (length,), generator=gen).tolist() for length in lengths]

    def run(paged: bool) -> torch.Tensor:
        runner._paged_kernel = paged
        history = [
            ChunkInput(ScheduledChunk(f"r{i}", 0, h, True, h), tokens[i], tables[i])
            for i, (h, _) in enumerate(shapes)
            if h > 0
        ]
        runner.execute(history)
        step = [
            ChunkInput(ScheduledChunk(f"r{i}", h, n, True, n), tokens[i], tables[i])
            for i, (h, n) in enumerate(shapes)
        ]
        batch = runner.prepare(step).batch
        expected = (True, 0) if paged else (False, 2)  # the two long chunks, one at a time
        assert (batch.paged is not None, len(batch.prefills)) == expected
        return runner.execute(step)

    kernel, per_request = run(True), run(False)
    torch.testing.assert_close(kernel, per_request, rtol=1e-5, atol=1e-5)
    assert kernel.argmax(-1).tolist() == per_request.argmax(-1).tolist()


def test_intra_op_threads_lowers_then_restores() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(before + 4):  # never raises the count
        assert torch.get_num_threads() == before


def test_small_steps_run_on_one_thread(monkeypatch) -> None:
    runner = _runner("llama")
    chunk = ChunkInput(ScheduledChunk("r0", 0, 4, True, 4), [5, 6, 7, 8], [1])
    seen: list[int] = []
    model = runner.model

    def spy(*args):
        seen.append(torch.get_num_threads())
        return model(*args)

    runner.model = spy
    before = torch.get_num_threads()
    runner.execute([chunk])
    monkeypatch.setattr(runner_module, "_PARALLEL_MIN_LAYER_MACS", 0)
    runner.execute([chunk])
    assert seen == [1, before]
    assert torch.get_num_threads() == before
