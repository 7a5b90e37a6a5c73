"""`tokenmill demo`: a tiny model, a sample dataset and jobs/demo.yaml, all on this machine.

Nothing is downloaded: the model comes from engines.dev.tiny (random weights, a locally trained
tokenizer), the prompts from its built-in text. The job file's paths are overridden to point
into the demo directory, so the demo runs from any working directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from engines.dev.tiny import make_tiny_model
from engines.quantize.calibration import sample_text
from pipeline.spec import JobSpec, load_job_spec

DEMO_JOB = Path(__file__).resolve().parents[3] / "jobs" / "demo.yaml"
_TASKS = ("Summarize", "Explain", "Answer briefly", "Continue the story", "List three facts about")
_TOPICS = ("storage", "engines", "rivers", "markets", "music", "weather")


def sample_rows(num_rows: int, seed: int = 0) -> list[dict[str, object]]:
    """Varied prompts (task, topic, length) with per-row max_tokens between 4 and 48."""

    rng = random.Random(seed)
    sentences = sample_text(num_sentences=max(num_rows * 3, 50), seed=seed)
    rows = []
    for i in range(num_rows):
        body = " ".join(rng.sample(sentences, rng.randint(1, 3)))
        rows.append(
            {
                "id": f"demo-{i:05d}",
                "prompt": f"{rng.choice(_TASKS)}: {body}",
                "max_tokens": rng.choice((4, 8, 16, 24, 32, 48)),
                "topic": rng.choice(_TOPICS),
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare_demo(
    workdir: Path,
    num_rows: int = 300,
    overrides: list[str] | None = None,
    emit: Callable[[str], None] = print,
) -> JobSpec:
    """Build (or reuse) the tiny model, write the prompts, and load jobs/demo.yaml for them."""
    if not DEMO_JOB.is_file():
        raise FileNotFoundError(
            f"{DEMO_JOB} not found: run `tokenmill demo` from a checkout of the repository"
        )
    workdir = workdir.resolve()
    model_dir = workdir / "model"
    if not (model_dir / "config.json").is_file():
        emit(f"building a tiny model in {model_dir} ...")
        make_tiny_model(model_dir, arch="llama", size="tiny")
    prompts = workdir / "prompts.jsonl"
    write_jsonl(prompts, sample_rows(num_rows))
    emit(f"wrote {num_rows} prompts to {prompts}")
    paths = [
        f"input.uri={prompts}",
        f"model.path={model_dir}",
        f"output.uri={workdir / 'results'}",
    ]
    return load_job_spec(DEMO_JOB, overrides=[*paths, *(overrides or [])])
