"""LoRA adapters in the job fingerprint: a job without them fingerprints as before they
existed (a run started before the upgrade resumes), one with them depends on which adapters,
their files and the column that picks them."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.batch.commit.fingerprint import job_fingerprint
from pipeline.engine_setup import engine_settings
from pipeline.spec import parse_job_spec


def _job(tmp_path: Path, **model: object) -> object:
    data = {
        "name": "j",
        "input": {"uri": "in.jsonl", "format": "jsonl", "prompt_column": "p"},
        "model": {"path": "/models/m", **model},
        "output": {"uri": str(tmp_path / "out")},
    }
    if model.get("adapters"):
        data["input"]["adapter_column"] = "who"
    return parse_job_spec(data)


def _adapter(folder: Path, rank: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"x" * rank)
    return str(folder)


def test_a_job_without_adapters_fingerprints_as_before(tmp_path: Path) -> None:
    spec = _job(tmp_path)
    settings = engine_settings(spec.engine)
    assert not {"max_loras", "max_lora_rank", "max_cpu_loras", "lora_adapters"} & set(settings)
    fingerprint = job_fingerprint(spec, [], model_info={})
    assert fingerprint.components == job_fingerprint(spec, [], model_info={}).components


def test_adapters_their_files_and_column_are_part_of_it(tmp_path: Path) -> None:
    plain = job_fingerprint(_job(tmp_path), [], model_info={})
    one = _adapter(tmp_path / "a", 8)
    with_one = job_fingerprint(_job(tmp_path, adapters={"a": one}), [], model_info={})
    assert with_one.changed_components(plain) == ["model", "prompt"]  # + adapter_column
    _adapter(tmp_path / "a", 16)  # the folder changed in place
    changed = job_fingerprint(_job(tmp_path, adapters={"a": one}), [], model_info={})
    assert changed.changed_components(with_one) == ["model"]
    missing = {"a": one, "gone": str(tmp_path / "nowhere")}
    # An unreadable adapter fails its rows, not the fingerprint.
    assert job_fingerprint(_job(tmp_path, adapters=missing), [], model_info={}).value
