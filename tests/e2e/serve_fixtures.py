"""Fixtures for the Serve endpoint tests: a tiny model and a running `tokenmill serve`.

The server is the real CLI in a subprocess on a free loopback port, started once per test
module (startup is ~10-20 s), with two models over the same weights: `tiny` with roomy queues
and `narrow` with one slot and one queue place, so the 429 path is easy to reach.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-1"
OTHER_KEY = "test-key-2"
MAX_BODY_BYTES = 64 * 1024
# Long enough that a capped request runs for seconds: disconnects land mid-generation.
MAX_MODEL_LEN = 2048
MAX_TOKENS_CAP = 2000
PRICES = {"input": 0.10, "cached_input": 0.05, "output": 0.40}
DEVICE_HOUR_USD = 0.05
# A loaded two-core machine starts a server with a vLLM engine in minutes, not seconds.
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_config(model_dir: Path, adapters: dict[str, Path] | None = None) -> dict:
    """`adapters`: LoRA adapters of `tiny` (name -> folder), answered under their names."""
    engine = {
        "kind": "reference",
        "device": "cpu",
        "max_batch_size": 16,
        "max_num_tokens": 256,
        "max_model_len": MAX_MODEL_LEN,
        # One thread per engine: two engines and the tests share two cores.
        "extra": {"num_threads": 1},
    }
    cost = {"device_hour_usd": DEVICE_HOUR_USD, "price_per_million": PRICES}
    limits = {"max_tokens": MAX_TOKENS_CAP, "default_max_tokens": 32}
    return {
        "name": "tokenmill-test",
        "models": [
            {
                "name": "tiny",
                "model": {
                    "path": str(model_dir),
                    "adapters": {n: str(p) for n, p in (adapters or {}).items()},
                },
                "engine": engine,
                "cost": cost,
                "limits": limits,
                # Autoscaling bounds, so that deployment path is exercised too; the tests
                # never hold 16 requests in flight, so it stays at one replica.
                "replicas": {
                    "cpus_per_replica": 0.25,
                    "max_ongoing_requests": 32,
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 16,
                },
            },
            {
                "name": "narrow",
                "model": {"path": str(model_dir)},
                "engine": engine,
                "cost": cost,
                "limits": limits,
                "replicas": {
                    "cpus_per_replica": 0.25,
                    "max_ongoing_requests": 1,
                    "max_queued_requests": 1,
                },
            },
        ],
        "http": {
            "max_body_bytes": MAX_BODY_BYTES,
            "retry_after_s": 2,
            "cpus_per_ingress": 0.25,
            # The shared tests scrape /metrics without a key; tests/e2e/test_serve_keys.py
            # checks the default (a key allowed to read it).
            "metrics_without_key": True,
        },
    }


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    lines: list[str] = field(default_factory=list)  # everything it printed so far

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, as a supervisor would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run `tokenmill ARGS` to completion; CompletedProcess with text output."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "tokenmill"), *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_server(config_path: Path, env: dict[str, str], extra_args: list[str]) -> ServerProcess:
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "tokenmill"),
        "serve",
        str(config_path),
        "--port",
        str(port),
        "--num-cpus",
        "2",
        "--object-store-mb",
        "300",
        *extra_args,
    ]
    # Never attach to a cluster someone else started: the server brings its own local Ray.
    base_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    process = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**base_env, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Its own process group, so a stuck server can be cleaned up without touching ours.
        start_new_session=True,
    )
    server = ServerProcess(process, f"http://127.0.0.1:{port}")
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.lines.append(line)
            if line.startswith("serving "):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.wait(timeout=1):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop(timeout=30)
            tail = "".join(server.lines[-40:])
            pytest.fail(f"tokenmill serve did not start (rc={process.returncode}):\n{tail}")
    return server


@pytest.fixture(scope="package")
def serve_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.dev.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("serve-model") / "tiny", arch="llama")


# What the shared server's `scripted` model answers: a sentence, then two calls (Hermes style).
TOOL_SCRIPT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"city": "Paris"}}\n</tool_call>'
)


# Two LoRA adapters of `tiny` on the shared server: the attention only, and every projection
# with rsLoRA (name -> rank, alpha, targets, rslora).
SERVE_ADAPTERS = {
    "tiny-qv": (8, 16, ("q_proj", "v_proj"), False),
    "tiny-all": (
        4,
        8,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        True,
    ),
}


@pytest.fixture(scope="package")
def serve_adapters(serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from engines.dev.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("serve-adapters")
    return {
        name: make_lora_adapter(
            root / name, serve_model_dir, rank=r, alpha=a, targets=t, use_rslora=rs, seed=20 + i
        )
        for i, (name, (r, a, t, rs)) in enumerate(SERVE_ADAPTERS.items())
    }


# Reasoning formats on the shared server (tests/e2e/test_serve_reasoning.py): a tiny model
# with each format's tokens and template, on the synthetic engine scripted to write a known
# reasoning part and answer. GPT-OSS's harmony: an analysis message, then a final one (the
# engine ends with <|return|>).
REASONING_ANSWER = "It is cold."
REASONING_SCRIPTS = {
    "think": ("the river runs north\n</think>\n\n" + REASONING_ANSWER, "the river runs north"),
    "harmony": (
        "<|channel|>analysis<|message|>The river runs north.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>" + REASONING_ANSWER,
        "The river runs north.",
    ),
}
# What the `harmony-tools` model writes: reasoning, a preamble, then two calls (the recipient
# before and after the channel, as GPT-OSS writes both).
HARMONY_CALLS_SCRIPT = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Paris"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"city": "Rome"}<|call|>'
)
# A served model whose name holds a slash (tests/e2e/test_serve_tolerance.py): `tiny`'s
# weights and settings under another name.
SLASHED_MODEL = "org/tiny-7b"


@pytest.fixture(scope="package")
def reasoning_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engines.dev.tiny import make_tiny_model

    base = tmp_path_factory.mktemp("reasoning-models")
    return {fmt: Path(make_tiny_model(base / fmt, reasoning=fmt)) for fmt in REASONING_SCRIPTS}


def slashed_model(model_dir: Path) -> dict:
    """The `models[]` entry of the model named with a slash: tiny's, renamed."""
    model = {**serve_config(model_dir)["models"][0], "name": SLASHED_MODEL}
    model["replicas"] = {"cpus_per_replica": 0.1, "max_ongoing_requests": 32}
    return model


def reasoning_entries(models: dict[str, Path]) -> list[dict]:
    """The shared server's reasoning models: one per format, and GPT-OSS calling tools."""
    # Steps of 20 ms: a stream arrives in several deltas even on a loaded machine.
    replicas = {"cpus_per_replica": 0.1, "stream_interval_s": 0}
    entries = [
        {
            "name": fmt,
            "model": {"path": str(models[fmt])},
            "engine": {
                "kind": "synthetic",
                "extra": {"script": script, "ttft_ms": 1, "step_interval_ms": 20},
            },
            "prompt": {"reasoning": fmt},
            "replicas": replicas,
        }
        for fmt, (script, _) in REASONING_SCRIPTS.items()
    ]
    entries.append(
        {
            "name": "harmony-tools",
            "model": {"path": str(models["harmony"])},
            "engine": {
                "kind": "synthetic",
                "extra": {"script": HARMONY_CALLS_SCRIPT, "ttft_ms": 1},
            },
            "prompt": {"reasoning": "harmony"},
            "replicas": replicas,
        }
    )
    return entries


@pytest.fixture(scope="package")
def vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL (random weights, its image processor), served as `vision`."""
    from engines.dev.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("vision") / "vl", arch="qwen2_5_vl"))


def vision_entry(model_dir: Path) -> dict:
    """The shared server's vision model: the reference engine on the tiny Qwen2.5-VL, at most
    two images per request, http images from this machine only (a test's own image host)."""
    engine = {**serve_config(model_dir)["models"][0]["engine"], "max_batch_size": 8}
    return {
        "name": "vision",
        "model": {"path": str(model_dir)},
        "engine": engine,
        # A held fetch outlasts the quick requests sent meanwhile on any machine.
        "prompt": {"images": {"max_images": 2, "http_hosts": ["127.0.0.1"], "http_timeout_s": 60}},
        "replicas": {"cpus_per_replica": 0.1, "max_ongoing_requests": 16},
    }


@pytest.fixture(scope="package")
def serve_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared server's files: serve.yaml, usage.jsonl (its usage log), server.log."""
    return tmp_path_factory.mktemp("serve-config")


# One server for the e2e tests (registered in tests/e2e/conftest.py): the modules that use it
# (test_serve_openai, _embeddings, _lora, _tools, _responses, _reasoning, _tolerance) agree on
# its configuration and leave it as they found it, and a start costs about a minute.
@pytest.fixture(scope="package")
def server(
    serve_model_dir: Path,
    serve_adapters: dict[str, Path],
    serve_workdir: Path,
    reasoning_models: dict[str, Path],
    vision_model_dir: Path,
) -> Iterator[ServerProcess]:
    config = serve_workdir / "serve.yaml"
    data = serve_config(serve_model_dir, serve_adapters)
    # A synthetic engine scripted to answer with text and tool calls: the tool parsers' paths
    # through the server (tests/e2e/test_serve_tools.py), whatever the weights would write.
    data["models"].append(
        {
            "name": "scripted",
            "model": {"path": str(serve_model_dir)},
            "engine": {
                "kind": "synthetic",
                "extra": {"script": TOOL_SCRIPT, "ttft_ms": 1, "step_interval_ms": 2},
            },
            "replicas": {"cpus_per_replica": 0.25, "stream_interval_s": 0},
        }
    )
    data["models"] += [
        slashed_model(serve_model_dir),
        *reasoning_entries(reasoning_models),
        vision_entry(vision_model_dir),
    ]
    data["usage_log"] = {"uri": str(serve_workdir / "usage.jsonl"), "flush_interval_s": 0.2}
    config.write_text(yaml.safe_dump(data))
    proc = start_server(config, {"TOKENMILL_API_KEYS": f"{API_KEY},{OTHER_KEY}"}, [])

    def stop() -> None:
        if proc.process.returncode is None:
            proc.stop()
            # Kept for a failing test's post-mortem (pytest keeps the last few base temp dirs).
            (config.parent / "server.log").write_text("".join(proc.lines))

    # tests/e2e/conftest.py stops it after the last test that uses it (SHARED).
    from tests.e2e import conftest

    conftest._closers["server"] = stop
    try:
        yield proc
    finally:
        conftest._closers.pop("server", None)
        stop()


# --- the served model's engine, run in the test process (what a response must equal) ----------


@contextmanager
def local_engine(model_dir: Path, served: dict) -> Iterator:
    """The reference engine with a served model's settings (one `models[]` entry)."""
    from engines import load_engine
    from pipeline.engine_setup import engine_settings
    from pipeline.serve.spec import ServedModelSpec

    spec = ServedModelSpec.model_validate(served)
    engine = load_engine(spec.engine.kind, model=str(model_dir), **engine_settings(spec.engine))
    try:
        yield engine
    finally:
        engine.shutdown()


def run_engine(engine, prompt_ids: list[int], max_tokens: int, **sampling):
    """One request on a local engine, greedy unless `sampling` says otherwise."""
    import asyncio

    from engines import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling})
    request = GenerationRequest(prompt_token_ids=list(prompt_ids), sampling=params)
    return asyncio.run(engine.generate(request))


def chat_ids(tokenizer, messages) -> list[int]:
    """The prompt ids the server's chat template gives `messages`."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
