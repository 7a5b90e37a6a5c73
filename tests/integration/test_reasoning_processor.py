"""The Ray Data processor with prompt.reasoning: the same split and counts as `tokenmill run`
(tests/e2e/test_reasoning_run.py), on the synthetic engine scripted in the think model's
tokens; a model without the tokens is refused before any actor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.spec import SpecError

pytestmark = pytest.mark.timeout(300)

SCRIPT = "the river runs north\n</think>\n\nIt is cold."


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("think") / "m", reasoning="think"))


def config(model: Path, **prompt: Any) -> dict[str, Any]:
    return {
        "input": {"id_column": "qid", "prompt_column": "q"},
        "prompt": {"reasoning": "think", **prompt},
        "model": {"path": str(model)},
        "engine": {"kind": "synthetic", "extra": {"script": SCRIPT, "ttft_ms": 1}},
        "sampling": {"max_tokens": 64},
        "resources": {"cpus_per_actor": 0.25, "batch_size": 4},
    }


def test_processor_rows_carry_reasoning(ray_local: Any, think_model: Path) -> None:
    import ray.data
    from transformers import AutoTokenizer

    from pipeline.data import build_processor

    tok = AutoTokenizer.from_pretrained(str(think_model))
    reasoning_tokens = tok.encode(SCRIPT, add_special_tokens=False).index(
        tok.convert_tokens_to_ids("</think>")
    )
    ds = ray.data.from_items([{"qid": "a", "q": "Why is the river cold?"}])
    (row,) = build_processor(config(think_model))(ds).take_all()
    assert (row["reasoning"], row["text"]) == ("the river runs north", "It is cold.")
    assert row["reasoning_tokens"] == reasoning_tokens
    # enable_thinking false: the template closes the block in the prompt, so the same output
    # has no reasoning block of its own and is all answer.
    (off,) = build_processor(config(think_model, enable_thinking=False))(ds).take_all()
    assert (off["reasoning"], off["text"], off["reasoning_tokens"]) == (None, SCRIPT, 0)


def test_a_model_without_the_tokens_is_refused(tiny_model_dir: Path) -> None:
    from pipeline.data import build_processor

    with pytest.raises(SpecError, match=r"prompt\.reasoning: .*'<think>' as one token"):
        build_processor(config(tiny_model_dir))


HARMONY_SCRIPT = (
    "<|channel|>analysis<|message|>The river runs north.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is cold."
)  # the engine ends it with the model's end-of-sequence token, <|return|>


def test_harmony_rows(ray_local: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    import ray.data
    from transformers import AutoTokenizer

    from engines.dev.tiny import make_tiny_model
    from pipeline.data import build_processor

    model = make_tiny_model(tmp_path_factory.mktemp("harmony") / "m", reasoning="harmony")
    tok = AutoTokenizer.from_pretrained(str(model))
    cfg = config(Path(model), reasoning="harmony", reasoning_effort="low")
    cfg["engine"]["extra"]["script"] = HARMONY_SCRIPT
    ds = ray.data.from_items([{"qid": "a", "q": "Why is the river cold?"}])
    (row,) = build_processor(cfg)(ds).take_all()
    assert (row["reasoning"], row["text"]) == ("The river runs north.", "It is cold.")
    assert row["reasoning_tokens"] == len(tok.encode("The river runs north."))
    # Every output token is still an output token: the markers, headers and <|return|> too.
    assert row["completion_tokens"] == len(tok.encode(HARMONY_SCRIPT)) + 1
