"""Serve with the engine under another environment's interpreter (replicas.engine_python), as
the TensorRT-LLM image runs it: Ray Serve and fastapi in this environment (.venv), the engine
process under .venv-trtllm (TensorRT-LLM 1.2's pure-Python pins, where Serve's fastapi cannot
install), speaking to the replica over engines/process.py's socket.

One server, two models on one tiny checkpoint (written by the other environment, whose
transformers reads only its own tokenizer format; this one reads both):
- `trt-here`: the TensorRT-LLM adapter over its stand-in, its engine process under this
  interpreter;
- `trt-there`: the same under the other interpreter.
The official client's chat, streaming, structured output, logprobs and n > 1 answer the same
on both; an engine process killed under load fails its requests with the engine-dead error
and the replica is replaced. The `slow` test adds `ref-there`, the reference engine under the
other interpreter, against the reference engine in this process (tests/unit/
test_process_engine.py checks the same without Serve in the default suite).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.e2e.serve_fixtures import (
    API_KEY,
    REPO,
    ServerProcess,
    chat_ids,
    local_engine,
    run_engine,
    start_server,
)

OTHER_PYTHON = REPO / ".venv-trtllm" / "bin" / "python"
STANDINS = REPO / "tests" / "standins"

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not OTHER_PYTHON.is_file(), reason=f"no {OTHER_PYTHON} (make setup-trtllm)"),
]

CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]
CHECK_PERIOD_S = 1.0
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve-elsewhere") / "tiny"
    build = "import sys; from engines.dev.tiny import make_tiny_model; make_tiny_model(sys.argv[1])"
    subprocess.run([str(OTHER_PYTHON), "-c", build, str(out)], cwd=REPO, check=True)
    return out


def served(name: str, model_dir: Path, kind: str, python: Path | None) -> dict:
    engine: dict = {
        "kind": kind,
        "max_batch_size": 16,
        "max_num_tokens": 256,
        "max_model_len": 1024,
    }
    if kind == "trtllm":
        engine["extra"] = {"check_gpu": False}  # the stand-in on CPU
    else:
        engine |= {"device": "cpu", "extra": {"num_threads": 1}}
    replicas: dict = {"cpus_per_replica": 0.25, "engine_process": True}
    if python is not None:
        replicas["engine_python"] = str(python)
    return {
        "name": name,
        "model": {"path": str(model_dir)},
        "engine": engine,
        "limits": {"max_tokens": 512, "default_max_tokens": 32},
        "replicas": replicas,
        "health": {"check_period_s": CHECK_PERIOD_S, "graceful_shutdown_timeout_s": 5},
    }


def config_for(model_dir: Path, *, reference: bool = False) -> dict:
    models = [
        served("trt-here", model_dir, "trtllm", None),
        served("trt-there", model_dir, "trtllm", OTHER_PYTHON),
    ]
    if reference:
        models.append(served("ref-there", model_dir, "reference", OTHER_PYTHON))
    return {"name": "tokenmill-elsewhere", "models": models, "http": {"cpus_per_ingress": 0.25}}


def start(model_dir: Path, directory: Path, *, reference: bool = False) -> ServerProcess:
    config = directory / "serve.yaml"
    config.write_text(yaml.safe_dump(config_for(model_dir, reference=reference)))
    # The stand-in on every engine process's path, and a step that takes time (the kill test
    # needs requests in flight); the other interpreter takes this environment's PYTHONPATH.
    env = {
        "TOKENMILL_API_KEYS": API_KEY,
        "PYTHONPATH": f"{STANDINS}{os.pathsep}{REPO}",
        "TOKENMILL_STANDIN_STEP_S": "0.003",
    }
    return start_server(config, env, [])


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("serve-elsewhere-config")
    proc = start(model_dir, directory)
    yield proc
    proc.stop()
    (directory / "server.log").write_text("".join(proc.lines))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


def both(client: openai.OpenAI, **request) -> tuple:
    """The same request to the engine here and the one under the other interpreter."""
    return tuple(
        client.chat.completions.create(model=name, messages=CHAT, **request)
        for name in ("trt-here", "trt-there")
    )


def test_the_engine_processes_run_under_their_interpreters(server: ServerProcess) -> None:
    for model, python in (
        ("trt-here", None),
        ("trt-there", OTHER_PYTHON),
    ):
        ((_, argv),) = engine_of(server, model)
        assert argv[0] == str(python) if python else argv[0] != str(OTHER_PYTHON)


def test_chat_logprobs_and_n_answer_the_same_under_either_interpreter(client) -> None:
    here, there = both(client, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2, n=2)
    assert [c.message.content for c in here.choices] == [c.message.content for c in there.choices]
    assert len(there.choices) == 2 and there.choices[0].message.content
    assert there.choices[0].message.content == there.choices[1].message.content  # greedy
    for a, b in zip(here.choices, there.choices, strict=True):
        assert a.logprobs.model_dump() == b.logprobs.model_dump()
    assert here.usage.completion_tokens == there.usage.completion_tokens > 0


def test_streams_answer_the_same_under_either_interpreter(client) -> None:
    texts = []
    for name in ("trt-here", "trt-there"):
        stream = client.chat.completions.create(
            model=name, messages=CHAT, temperature=0, max_tokens=20, stream=True
        )
        texts.append(
            "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        )
    assert texts[0] == texts[1] and texts[0]


def test_structured_output_answers_the_same_under_either_interpreter(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    here, there = both(client, temperature=0, max_tokens=64, response_format=fmt)
    assert here.choices[0].message.content == there.choices[0].message.content
    value = json.loads(there.choices[0].message.content)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)


@pytest.mark.slow
def test_the_reference_engine_there_answers_as_it_does_here(
    model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model = config_for(model_dir, reference=True)["models"][2]
    with local_engine(model_dir, model) as engine:
        expected = run_engine(engine, chat_ids(AutoTokenizer.from_pretrained(model_dir), CHAT), 24)
    proc = start(model_dir, tmp_path, reference=True)
    try:
        client = openai.OpenAI(base_url=proc.api_url, api_key=API_KEY, max_retries=0, timeout=120)
        response = client.chat.completions.create(
            model="ref-there", messages=CHAT, temperature=0, max_tokens=24
        )
        ((_, argv),) = engine_of(proc, "ref-there")
    finally:
        proc.stop()
    assert argv[0] == str(OTHER_PYTHON)
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == expected.completion_tokens


def test_an_engine_process_killed_under_load_fails_its_requests_and_is_replaced(
    server: ServerProcess, client
) -> None:
    ((pid, _),) = engine_of(server, "trt-there")
    streaming = threading.Barrier(5)  # four streams with tokens out, and this thread
    outcomes: list[object] = []

    def one() -> None:
        try:
            stream = client.chat.completions.create(
                model="trt-there", messages=CHAT, temperature=0, max_tokens=2000, stream=True
            )
            for i, _ in enumerate(stream):
                if i == 1:
                    streaming.wait(60)
            outcomes.append("finished")  # the engine died after all its tokens: not expected
        except openai.APIError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    streaming.wait(60)  # every request is in flight
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert len(outcomes) == 4 and "finished" not in outcomes, outcomes
    for exc in outcomes:
        assert "EngineDeadError" in str(exc) or "engine process has stopped" in str(exc), exc
    # Replaced: a new engine process under the other interpreter serves the next requests.
    deadline = time.monotonic() + 240
    while True:
        try:
            answer = client.chat.completions.create(
                model="trt-there", messages=CHAT, temperature=0, max_tokens=4
            )
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(1)
    assert answer.choices[0].finish_reason in ("stop", "length")
    ((new, argv),) = engine_of(server, "trt-there")
    assert new != pid and argv[0] == str(OTHER_PYTHON)


def engine_processes(server: ServerProcess) -> list[tuple[int, list[str], str]]:
    """(pid, argv, the replica's process title) of the engine processes below this server's
    own process; the title (Ray's "ray::ServeReplica:APP:engine-MODEL") says whose it is."""
    import psutil

    found = []
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            argv = child.cmdline()
            if "-m" in argv and "engines.process" in argv:
                found.append((child.pid, argv, " ".join(child.parent().cmdline())))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def engine_of(server: ServerProcess, model: str) -> list[tuple[int, list[str]]]:
    return [(p, argv) for p, argv, title in engine_processes(server) if f"engine-{model}" in title]
