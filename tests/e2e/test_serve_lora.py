"""LoRA adapters through `tokenmill serve` and the official openai client: `model=<adapter>`
answers with the adapter (greedy ids equal to transformers on the adapter merged into the
base), /v1/models lists the adapters under their model, an unknown adapter is OpenAI's 404,
and each request's usage record names its adapter.

The shared server (serve_fixtures.server) serves `tiny` with two adapters, SERVE_ADAPTERS."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from engines import GenerationRequest, SamplingParams
from tests.e2e.serve_fixtures import (
    API_KEY,
    ServerProcess,
    chat_ids,
    local_engine,
    run_engine,
    serve_config,
)
from tests.engine_fixtures import hf_greedy

pytestmark = pytest.mark.usefixtures("server")

CHAT = [{"role": "user", "content": "Name three rivers and a bridge over each."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def merged(serve_model_dir: Path, serve_adapters: dict[str, Path], tmp_path_factory) -> dict:
    from engines.dev.lora import merge_lora

    root = tmp_path_factory.mktemp("serve-merged")
    return {n: merge_lora(serve_model_dir, p, root / n) for n, p in serve_adapters.items()}


@pytest.fixture(scope="module")
def tokenizer(serve_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serve_model_dir))


def test_each_adapter_answers_as_transformers_with_it_merged(
    client: openai.OpenAI, serve_model_dir: Path, merged: dict[str, Path], tokenizer
) -> None:
    ids = chat_ids(tokenizer, CHAT)
    served = serve_config(serve_model_dir)["models"][0]
    texts = {}
    for name, folder in {"tiny": serve_model_dir, **merged}.items():
        # The expectation: the merged model's greedy ids (transformers), and their text as
        # the reference engine detokenizes it.
        want = hf_greedy(
            folder,
            [GenerationRequest(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))],
        )[0]
        with local_engine(folder, served) as engine:
            local = run_engine(engine, ids, MAX_TOKENS, ignore_eos=True)
        assert list(local.output_token_ids) == want, name
        response = client.chat.completions.create(
            model=name,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.model == name
        assert response.choices[0].message.content == local.text, name
        assert response.usage.completion_tokens == MAX_TOKENS
        texts[name] = local.text
    # The adapters change the answer: three different texts (else the test proves nothing).
    assert len(set(texts.values())) == 3, texts
    # Streamed, an adapter's deltas add up to the same text.
    stream = client.chat.completions.create(
        model="tiny-all",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"tiny-all"}
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["tiny-all"]
    )


def test_models_lists_adapters_under_their_model(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list()}
    assert cards["tiny-qv"].model_extra["parent"] == "tiny"
    assert cards["tiny-all"].model_extra["parent"] == "tiny"
    assert "parent" not in (cards["tiny"].model_extra or {})
    assert client.models.retrieve("tiny-qv").model_extra["parent"] == "tiny"


def test_an_unknown_adapter_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="tiny-nope", prompt="hello", max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "tiny-nope" in error["message"] and "tiny-qv" in error["message"]


def test_embeddings_refuse_an_adapter_naming_its_model(server: ServerProcess) -> None:
    response = httpx.post(
        server.api_url + "/embeddings",
        json={"model": "tiny-qv", "input": "hello"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "'tiny'" in response.json()["error"]["message"]


def test_usage_records_name_the_adapter(client: openai.OpenAI, serve_workdir: Path) -> None:
    marker = f"usage-{time.time_ns()}"
    sent = {}
    for name in ("tiny-qv", "tiny"):
        response = client.completions.create(
            model=name, prompt=f"{marker} {name}", max_tokens=3, temperature=0
        )
        sent[response.id] = name
    log = serve_workdir / "usage.jsonl"
    deadline = time.monotonic() + 30
    records: dict[str, dict] = {}
    while time.monotonic() < deadline and set(records) != set(sent):
        if log.exists():
            lines = [json.loads(line) for line in log.read_text().splitlines() if line]
            records = {r["request_id"]: r for r in lines if r["request_id"] in sent}
        time.sleep(0.2)
    assert set(records) == set(sent), "the usage log never recorded both requests"
    for request_id, name in sent.items():
        record = records[request_id]
        assert record["model"] == "tiny"
        assert record["adapter"] == (None if name == "tiny" else name)
        assert record["completion_tokens"] > 0 and record["cost_usd"] > 0
