"""http.direct_ingress: false, Serve's Python proxy actor in front of the ingress replica
instead of HAProxy (the default, which every other serve test runs through). The same endpoint
answers the same way: greedy chat equal to the engine, streaming, n choices, auth, health; and a
client leaving a whole-answer request cancels it on this path too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.e2e.serve_fixtures import (
    API_KEY,
    ServerProcess,
    chat_ids,
    local_engine,
    run_engine,
    serve_config,
    start_server,
)
from tests.e2e.test_serve_openai import READY_WITHIN_S, check_whole_response_disconnect_cancels

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]


@pytest.fixture(scope="module")
def server(serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    config = serve_config(serve_model_dir)
    model = {**config["models"][0], "replicas": {"cpus_per_replica": 0.25}}
    data = {**config, "name": "tokenmill-proxy", "models": [model]}
    data["http"] = {**data.get("http", {}), "direct_ingress": False}
    path = tmp_path_factory.mktemp("serve-proxy") / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    yield proc
    proc.stop()
    (path.parent / "server.log").write_text("".join(proc.lines))


def test_the_endpoint_behaves_the_same(server: ServerProcess, serve_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)
    ids = chat_ids(AutoTokenizer.from_pretrained(str(serve_model_dir)), CHAT)
    with local_engine(serve_model_dir, serve_config(serve_model_dir)["models"][0]) as engine:
        expected = run_engine(engine, ids, max_tokens=12)
    answer = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=12
    )
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, temperature=0, max_tokens=12, n=2, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: expected.text, 1: expected.text}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0).models.list()
    # The probe apps, routed by Serve's proxy on this path.
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    deadline = time.monotonic() + READY_WITHIN_S
    while (ready := httpx.get(server.base_url + "/ready", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, f"/ready {ready.status_code} for {READY_WITHIN_S} s"
        time.sleep(0.2)
    assert ready.json()["models_serving"] == 1


def test_client_leaving_a_whole_answer_cancels_it(server: ServerProcess) -> None:
    check_whole_response_disconnect_cancels(server)
