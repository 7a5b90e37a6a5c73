"""The device check's Serve step: the checkpoint the batch runs used, served the way
jobs/serve-gpu-trtllm.yaml serves the nightly's FP8 artifact.

`tokenmill serve` runs from Serve's environment (`serve_bin`: /opt/serve-env/bin in
images/trtllm.Dockerfile), and each replica runs its engine in a process under `engine_python`
(replicas.engine_python: the interpreter running the device check, the container's own, where
TensorRT-LLM is). Greedy completions of the batch prompts through HTTP, `concurrency` at a
time: requests/s, time to first token (streamed), and agreement with the batch run's texts for
the same engine and checkpoint (the same engine, prompts and greedy settings: equal texts).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

KEY = "device-check-key"
STARTUP_TIMEOUT_S = 900.0  # TensorRT-LLM loads, autotunes and captures CUDA graphs first


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_file(
    work: Path,
    model: Path,
    engine: str,
    settings: dict[str, Any],
    engine_python: str,
    device: str,
) -> Path:
    on_gpu = device == "cuda"
    config = {
        "name": "device-check",
        "models": [
            {
                "name": "check",
                "model": {"path": str(model)},
                "engine": {"kind": engine, "dtype": "bfloat16" if on_gpu else "float32"} | settings,
                "replicas": {
                    "engine_python": engine_python,
                    "devices_per_replica": 1 if on_gpu else 0,
                    "cpus_per_replica": 1 if on_gpu else 0.25,
                    "max_ongoing_requests": 256,
                },
                "limits": {"max_tokens": 4096},
            }
        ],
        "http": {"cpus_per_ingress": 0.25},
    }
    path = work / f"serve-{engine}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


class Server:
    """`tokenmill serve` from Serve's environment, until stopped."""

    def __init__(self, serve_bin: Path, config: Path, num_cpus: int, log: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
        env["TOKENMILL_API_KEYS"] = KEY
        self._log = log.open("w")
        command = [str(serve_bin / "tokenmill"), "serve", str(config), "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, "--num-cpus", str(num_cpus)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready.wait(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tokenmill serve did not start; its log: {log}")

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("serving "):
                self._ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # the server stops its replicas
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()


def _complete(client: Any, prompt: str, max_tokens: int) -> tuple[str, float, float]:
    """One streamed greedy chat completion (the batch job renders its prompt column with the
    chat template too): its text, seconds to the first token, seconds in all."""
    started = time.monotonic()
    first = None
    parts = []
    body = {
        "model": "check",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :])["choices"]
            text = choices[0]["delta"].get("content") if choices else None
            if text and first is None:
                first = time.monotonic() - started
            parts.append(text or "")
    total = time.monotonic() - started
    return "".join(parts), first if first is not None else total, total


def serve_check(
    *,
    work: Path,
    model: Path,
    engine: str,
    settings: dict[str, Any],
    serve_bin: Path,
    engine_python: str,
    device: str,
    prompts: dict[str, str],
    batch_texts: dict[str, str],
    max_tokens: int,
    concurrency: int = 16,
) -> dict[str, Any]:
    """Serve `model` with `engine` through Serve's environment and compare with the batch run."""
    import httpx

    from engines.quantize.quality import matched_prefix

    config = serve_file(work, model, engine, settings, engine_python, device)
    started = time.monotonic()
    server = Server(serve_bin, config, num_cpus=os.cpu_count() or 2, log=work / "serve.log")
    startup_s = time.monotonic() - started
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=600) as client:
            models = client.get("/models").json()["data"]
            _complete(client, "warm up", 4)  # the first request pays lazy setup
            ids = sorted(prompts)
            began = time.monotonic()
            with ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(lambda i: _complete(client, prompts[i], max_tokens), ids))
            wall = time.monotonic() - began
    finally:
        server.stop()
    texts = dict(zip(ids, (a[0] for a in answers), strict=True))
    same = [i for i in ids if texts[i] == batch_texts.get(i)]
    shared = [
        matched_prefix(list(texts[i]), list(batch_texts.get(i, ""))) / max(1, len(texts[i]))
        for i in ids
    ]
    ttft = sorted(a[1] for a in answers)
    return {
        "engine": engine,
        "engine_python": engine_python,
        "serve_python": str(serve_bin / "python"),
        "models": [m["id"] for m in models],
        "startup_s": round(startup_s, 1),
        "requests": len(ids),
        "concurrency": concurrency,
        "requests_per_s": round(len(ids) / wall, 2),
        "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1),
        "ttft_p90_ms": round(1000 * ttft[int(len(ttft) * 0.9)], 1),
        "same_text_as_batch": round(len(same) / len(ids), 3),
        "shared_prefix_with_batch": round(sum(shared) / len(shared), 3),
    }
