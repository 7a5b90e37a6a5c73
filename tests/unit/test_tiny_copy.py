"""engines.dev.tiny_copy: the copy task's batches, the length curriculum, and that a (barely)
trained copier is saved as a checkpoint the reference engine runs, cached by its settings and
refused when it does not copy. Training here is a few steps; the real run takes minutes."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from engines.dev.tiny_copy import (
    CopyTraining,
    CopyTrainingFailed,
    copy_batch,
    copy_prompts,
    ensure_copy_model,
    passage_cap,
)

# A few steps on short passages of the smallest shape: seconds, and far from copying.
QUICK = CopyTraining(
    size="tiny", passage_len=(4, 12), short_len=8, ramp=(2, 4), steps=6, batch_size=4, threads=1
)


def test_copy_batch_repeats_the_passage_and_scores_only_the_copy() -> None:
    ids, labels = copy_batch(random.Random(0), vocab_size=50, sep_id=1, batch_size=3, length=5)
    assert ids.shape == labels.shape == (3, 11)
    assert (ids[:, 5] == 1).all()
    assert (ids[:, :5] == ids[:, 6:]).all()
    assert (ids[:, :5] >= 3).all()  # no special ids inside a passage
    assert (labels[:, :6] == -100).all()
    assert (labels[:, 6:] == ids[:, 6:]).all()


def test_held_out_prompts_end_with_the_separator_and_are_seeded() -> None:
    prompts = copy_prompts(4, vocab_size=100, sep_id=1, length=7)
    assert prompts == copy_prompts(4, vocab_size=100, sep_id=1, length=7)
    assert all(len(p) == 8 and p[-1] == 1 and 1 not in p[:-1] for p in prompts)


def test_passage_cap_stays_short_then_ramps_to_the_longest() -> None:
    config = CopyTraining(passage_len=(8, 256), short_len=48, ramp=(100, 200))
    assert passage_cap(0, config) == passage_cap(100, config) == 48
    assert passage_cap(150, config) == 152
    assert passage_cap(200, config) == passage_cap(10_000, config) == 256


def test_cache_key_ignores_speed_and_the_bar() -> None:
    assert CopyTraining().key() == CopyTraining(threads=8, min_copy_share=0.5).key()
    assert CopyTraining().key() != CopyTraining(steps=10).key()


def test_untrained_copier_is_saved_loadable_and_refused(tmp_path: Path) -> None:
    from engines.api import GenerationRequest, SamplingParams
    from engines.reference.engine import ReferenceEngine
    from tests.engine_fixtures import run_all

    with pytest.raises(CopyTrainingFailed, match="copies"):
        ensure_copy_model(QUICK, cache_dir=tmp_path)
    (model_dir,) = tmp_path.iterdir()
    assert QUICK.key() in model_dir.name
    assert (model_dir / "model.safetensors").exists()
    assert (model_dir / "tokenizer.json").exists()

    # Cached: a second call reads the saved report instead of training again.
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(CopyTrainingFailed):
        ensure_copy_model(QUICK, cache_dir=tmp_path)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before

    # With the bar at zero the same checkpoint passes, and the reference engine runs it.
    path, report, sep_id = ensure_copy_model(replace(QUICK, min_copy_share=0.0), cache_dir=tmp_path)
    assert path == model_dir and 0.0 <= report.copy_share < 0.5
    engine = ReferenceEngine(str(path), num_threads=1)
    try:
        prompt = copy_prompts(1, 1024, sep_id, 8)[0]
        request = GenerationRequest(
            prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
        (result,) = run_all(engine, [request])
    finally:
        engine.shutdown()
    assert result.completion_tokens == 4
