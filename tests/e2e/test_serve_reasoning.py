"""Reasoning output through `tokenmill serve` (real HTTP, the official OpenAI client): a model
with prompt.reasoning think on the synthetic engine, scripted to write a known reasoning block
and answer in the tiny think model's tokens, so content, reasoning_content (whole and streamed)
and the usage counts are known exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.e2e.serve_fixtures import API_KEY, ServerProcess, start_server

pytestmark = pytest.mark.timeout(400)

REASONING = "the river runs north"
ANSWER = "It is cold."
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}"
CHAT = [{"role": "user", "content": "Why is the river cold?"}]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("model") / "think", reasoning="think"))


@pytest.fixture(scope="module")
def counts(think_model: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(think_model))
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    return {
        "reasoning": ids.index(tok.convert_tokens_to_ids("</think>")),
        "completion": len(ids) + 1,  # + the end-of-sequence token
    }


@pytest.fixture(scope="module")
def server(think_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = {
        "name": "tokenmill-reasoning",
        "models": [
            {
                "name": "think",
                "model": {"path": str(think_model)},
                # Steps of a few ms: a stream arrives in several deltas.
                "engine": {
                    "kind": "synthetic",
                    "extra": {"script": SCRIPT, "ttft_ms": 1, "step_interval_ms": 5},
                },
                "prompt": {"reasoning": "think"},
                "replicas": {"cpus_per_replica": 0.25, "stream_interval_s": 0},
            }
        ],
        "http": {"cpus_per_ingress": 0.25},
    }
    path = tmp_path_factory.mktemp("serve-config") / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    yield proc
    proc.stop()
    (path.parent / "server.log").write_text("".join(proc.lines))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_whole_answer(client: openai.OpenAI, counts: dict[str, int]) -> None:
    reply = client.chat.completions.create(model="think", messages=CHAT, max_tokens=64)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    assert reply.usage.completion_tokens == counts["completion"]  # tokens are tokens
    assert reply.usage.completion_tokens_details.reasoning_tokens == counts["reasoning"]
    # reasoning_effort is accepted and reaches the template (its system turn: more tokens).
    effort = client.chat.completions.create(
        model="think", messages=CHAT, max_tokens=64, reasoning_effort="high"
    )
    assert effort.usage.prompt_tokens > reply.usage.prompt_tokens
    # n choices: each split, the usage counting every choice's reasoning.
    two = client.chat.completions.create(
        model="think", messages=CHAT, max_tokens=64, n=2, temperature=1.0
    )
    assert [c.message.model_extra["reasoning_content"] for c in two.choices] == [REASONING] * 2
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * counts["reasoning"]
    # Cut at max_tokens inside the block: all reasoning, an empty answer.
    cut = client.chat.completions.create(model="think", messages=CHAT, max_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert (cut.choices[0].message.content, cut.choices[0].message.model_extra) == (
        "",
        {"reasoning_content": "the river"},
    )
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3


def test_streamed_answer(client: openai.OpenAI, counts: dict[str, int]) -> None:
    stream = client.chat.completions.create(
        model="think",
        messages=CHAT,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[tuple[str, str]] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                parts.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                parts.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # reasoning first
    assert kinds.count("reasoning") > 1  # really streamed, not one piece at the end
    assert "".join(t for k, t in parts if k == "reasoning") == REASONING
    assert "".join(t for k, t in parts if k == "content") == ANSWER
    assert usage is not None
    assert usage.completion_tokens == counts["completion"]
    assert usage.completion_tokens_details.reasoning_tokens == counts["reasoning"]
