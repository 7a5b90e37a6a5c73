"""Models, tokenizers and LoRA adapters named as Hugging Face Hub sources (hf://ORG/NAME@REV),
fetched over real HTTP from a local server speaking the hub's file API (HF_ENDPOINT), with a
token from the environment: downloaded once per node into the cache, fingerprinted by commit
without downloading, and run by an engine exactly as the same folders on disk."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.spec import ModelSpec, SpecError, StorageSpec
from tests.integration.hf_server import HubServer, running_hub

TOKEN = "hf_test_token"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with running_hub(token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.lora import make_lora_adapter

    return make_lora_adapter(tmp_path_factory.mktemp("hub") / "ft", tiny_model_dir, seed=5)


def test_a_model_comes_once_from_the_hub_and_is_fingerprinted_by_commit(
    hub: HubServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from pipeline.batch.commit.fingerprint import model_content
    from pipeline.storage import materialize_model

    commit = hub.publish("org/tiny", tiny_model_dir)
    cache = str(tmp_path / "cache")
    local = materialize_model("hf://org/tiny", cache, StorageSpec())
    assert (local / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    assert str(local).startswith(cache) and commit in str(local)  # the commit's snapshot
    fetched = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert len(fetched) == len(list(tiny_model_dir.iterdir()))
    # Once per node: the second call downloads no file again.
    assert materialize_model("hf://org/tiny@main", cache, StorageSpec()) == local
    assert [p for m, p in hub.requests if m == "GET" and "/resolve/" in p] == fetched
    # Only some files (a tokenizer's), on request.
    only = materialize_model(
        "hf://org/tiny", str(tmp_path / "c2"), StorageSpec(), patterns=("tokenizer*",)
    )
    assert sorted(p.name for p in only.iterdir()) == sorted(
        ["config.json", *(p.name for p in tiny_model_dir.glob("tokenizer*"))]
    )
    # The fingerprint: the commit and sizes, from the API; new contents are a new commit.
    before = model_content("hf://org/tiny", StorageSpec())
    assert before["commit"] == commit and "config.json" in before["files"]
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    (changed / "generation_config.json").write_text('{"do_sample": false}')
    hub.publish("org/tiny", changed)
    assert model_content("hf://org/tiny", StorageSpec())["commit"] != commit


def test_what_cannot_be_read_names_the_field_the_source_and_what_to_do(
    hub: HubServer, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.storage import materialize_model

    hub.publish("org/tiny", tiny_model_dir, revision="v1")
    cache = str(tmp_path / "cache")
    for uri, words in (
        ("hf://org/missing", "hf://org/missing"),
        ("hf://org/tiny@v2", "hf://org/tiny@v2"),
        ("hf://not a repo", "not a Hugging Face Hub source"),
    ):
        with pytest.raises(SpecError, match=r"model\.path") as caught:
            materialize_model(uri, cache, StorageSpec())
        assert words in str(caught.value)
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(SpecError, match="HF_TOKEN"):
        materialize_model("hf://org/tiny@v1", cache, StorageSpec())
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(SpecError, match=r"has no adapter_config\.json"):
        materialize_model(
            "hf://org/tiny@v1", cache, StorageSpec(), required_file="adapter_config.json"
        )


def test_an_engine_runs_a_hub_model_and_a_hub_adapter_as_the_same_folders_on_disk(
    hub: HubServer, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    from engines.api import GenerationRequest, SamplingParams
    from pipeline.engine_setup import open_engine
    from pipeline.spec import EngineSpec

    hub.publish("org/tiny", tiny_model_dir, revision="v1")
    hub.publish("org/tiny-ft", adapter_dir)
    engine_spec = EngineSpec(kind="reference", device="cpu", max_model_len=256)
    cache = str(tmp_path / "cache")

    def texts(model: ModelSpec) -> list[str]:
        engine = open_engine(model, engine_spec, StorageSpec())
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        requests = [GenerationRequest([5, 6, 7, 8], sampling, adapter=a) for a in (None, "ft")]

        async def go() -> list[str]:
            return [r.text for r in await asyncio.gather(*(engine.generate(q) for q in requests))]

        try:
            return asyncio.run(go())
        finally:
            engine.shutdown()

    from_hub = texts(
        ModelSpec(path="hf://org/tiny@v1", adapters={"ft": "hf://org/tiny-ft"}, cache_dir=cache)
    )
    on_disk = texts(ModelSpec(path=str(tiny_model_dir), adapters={"ft": str(adapter_dir)}))
    assert from_hub == on_disk and from_hub[0] != from_hub[1]
