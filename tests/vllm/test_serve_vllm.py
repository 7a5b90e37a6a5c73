"""`tokenmill serve` with engine.kind vllm: the OpenAI endpoint answers chat and completion
requests, plain and streamed, over real HTTP with the official client, with the usage and
cost a reference-engine model gets, and the same greedy text as the reference engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from tests.e2e.serve_fixtures import API_KEY, ServerProcess, serve_config, start_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from engines.dev.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("vllm-serve") / "llama", size="tiny-hd32")
    config = serve_config(model)
    reference, _ = config["models"]
    served_vllm = {
        **reference,
        "name": "tiny-vllm",
        "engine": {
            "kind": "vllm",
            "max_batch_size": 16,
            "max_num_tokens": 256,
            "max_model_len": 2048,
            "kv_cache_tokens": 8192,
            "extra": {"enforce_eager": True},
        },
        "replicas": {"cpus_per_replica": 0.25, "max_ongoing_requests": 32},
    }
    config["models"] = [reference, served_vllm]
    path = tmp_path_factory.mktemp("vllm-serve-config") / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    yield proc
    proc.stop()
    (path.parent / "server.log").write_text("".join(proc.lines))


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    from openai import OpenAI

    return OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, model: str, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the river and the bridge."}],
        max_tokens=12,
        temperature=0,
        **kw,
    )


def test_chat_on_vllm_equals_the_reference_engine(client) -> None:
    got = chat(client, "tiny-vllm")
    want = chat(client, "tiny")
    assert got.model == "tiny-vllm"
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens > 0


def test_streamed_chat_on_vllm_adds_up_to_the_whole_reply(client) -> None:
    whole = chat(client, "tiny-vllm").choices[0].message.content
    stream = chat(client, "tiny-vllm", stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole
    assert usage is not None and usage.completion_tokens > 0


def test_completion_on_vllm_reports_usage(client) -> None:
    done = client.completions.create(
        model="tiny-vllm", prompt="The cluster reads the manifest", max_tokens=5, temperature=0
    )
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 5
    assert done.usage.prompt_tokens > 0
