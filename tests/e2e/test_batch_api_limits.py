"""The Batch API under load from one key, against a real `tokenmill serve` on loopback: a
flood of /v1/files and /v1/batches calls from a limited key gets 429s and leaves other keys'
chat latency alone, and (slow) eight 100 MB uploads at once leave the ingress's memory flat.

No batch job runs here (no Jobs API is needed): the flood's batches name a model the server
does not have, so they fail during validating without a job, and the upload test only stores.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.e2e.serve_fixtures import API_KEY, ServerProcess, serve_config, start_server

pytestmark = pytest.mark.timeout(600)

FLOOD_KEY, CALM_KEY = "key-flood", "key-calm"
FLOOD_RPM = 20
# Bounded: FLOODERS clients send FLOOD_REQUESTS calls each per round, ROUNDS rounds; quiet
# stretches between the rounds, so a change in the machine's other load over the test's time
# falls on both the quiet and the flooded measurements.
FLOODERS, FLOOD_REQUESTS, ROUNDS = 4, 20, 3
QUIET_REQUESTS = 8  # chat requests measured before each round
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me about the river."}],
    "max_tokens": 8,
    "temperature": 0,
}
UPLOAD_CLIENTS = 8
UPLOAD_BYTES = 100 * 1024 * 1024
LINE_BYTES = 2048


def _entry(name: str, key: str, **fields: object) -> dict:
    return {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), **fields}


def _server(model_dir: Path, root: Path, batch_api: dict) -> ServerProcess:
    keys_file = root / "keys.yaml"
    flood = _entry(
        "flood", FLOOD_KEY, limits={"requests_per_minute": FLOOD_RPM, "max_concurrent": 2}
    )
    keys_file.write_text(yaml.safe_dump({"keys": [flood, _entry("calm", CALM_KEY)]}))
    config = serve_config(model_dir)
    tiny = config["models"][0]
    tiny["replicas"] = {"cpus_per_replica": 0.25, "max_ongoing_requests": 8}
    tiny["batch"] = {"max_tokens": 8}
    config["models"] = [tiny]  # one_hop: the engine runs inside the ingress replica
    config["name"] = "tokenmill-batch-limits"
    config["auth"] = {"keys_file": str(keys_file)}
    config["batch_api"] = {"uri": str(root / "store"), **batch_api}
    path = root / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])


def _ingress_process(server: ServerProcess) -> psutil.Process:
    """The ingress replica's process among the server's descendants (its local Ray)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for proc in psutil.Process(server.process.pid).children(recursive=True):
            try:
                if "OpenAIIngress" in " ".join(proc.cmdline()):
                    return proc
            except psutil.Error:
                continue
        time.sleep(0.5)
    raise AssertionError("no OpenAIIngress replica process under the server within 30 s")


def _chat_latency(client: httpx.Client) -> float:
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=CHAT)
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    return elapsed


def _flood_body(i: int) -> tuple[bytes, str]:
    """A small batch file (multipart) whose lines name a model this server lacks."""
    line = {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "nope", "messages": [{"role": "user", "content": "x" * 200}]},
    }
    content = "".join(json.dumps({**line, "custom_id": f"req-{j}"}) + "\n" for j in range(200))
    boundary = f"flood{i}"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="f{i}.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n{content}\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    return body, f"multipart/form-data; boundary={boundary}"


@pytest.fixture(scope="module")
def flood_server(serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    root = tmp_path_factory.mktemp("batch-limits")
    proc = _server(serve_model_dir, root, {})
    yield proc
    proc.stop()
    (root / "server.log").write_text("".join(proc.lines))


def _flooder(base: str, n: int) -> tuple[Counter[int], list[str]]:
    """One flooding client: FLOOD_REQUESTS calls, back to back, cycling through an upload, a
    file list, a batch create and a batch list. Its statuses, and anything unexpected."""
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    client = httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {FLOOD_KEY}"}, timeout=60
    )
    file_id = None
    for i in range(FLOOD_REQUESTS):
        kind = i % 4
        try:
            if kind == 0:
                body, content_type = _flood_body(n * 1000 + i)
                r = client.post("/v1/files", content=body, headers={"Content-Type": content_type})
                if r.status_code == 200:
                    file_id = r.json()["id"]
            elif kind == 1:
                r = client.get("/v1/files")
            elif kind == 2:
                create = {
                    "input_file_id": file_id or "file-none",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
                r = client.post("/v1/batches", json=create)
            else:
                r = client.get("/v1/batches")
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        statuses[r.status_code] += 1
        if r.status_code == 429:
            error = r.json().get("error") or {}  # OpenAI's error shape, with a Retry-After
            if not (error.get("code") and error.get("type") and r.headers.get("retry-after")):
                errors.append(f"429 not in OpenAI's shape: {r.text[:200]}")
        elif r.status_code >= 500:
            errors.append(f"{r.status_code}: {r.text[:200]}")
    return statuses, errors


def _flood(base: str, round_: int) -> tuple[Counter[int], list[str]]:
    """FLOODERS clients at once, run in a process of their own at low priority: on a real
    deployment the flood's clients do not share the server's CPUs, here they share two."""
    if round_ == 0:
        os.nice(10)
    with ThreadPoolExecutor(FLOODERS) as pool:
        numbers = range(round_ * FLOODERS, (round_ + 1) * FLOODERS)
        results = list(pool.map(lambda n: _flooder(base, n), numbers))
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    for counts, found in results:
        statuses.update(counts)
        errors += found
    return statuses, errors


def test_batch_api_flood_from_one_key(flood_server: ServerProcess) -> None:
    base = flood_server.base_url
    calm = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {CALM_KEY}"}, timeout=60)
    for _ in range(3):  # warm: tokenizer, engine info, first step
        _chat_latency(calm)
    test_started = time.monotonic()
    unloaded: list[float] = []
    loaded: list[float] = []
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    flood_s = 0.0
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        _ = pool.submit(int).result(timeout=60)  # the process is up before the clock starts
        for round_ in range(ROUNDS):
            unloaded += [_chat_latency(calm) for _ in range(QUIET_REQUESTS)]
            started = time.monotonic()
            flood = pool.submit(_flood, base, round_)
            while not flood.done():
                loaded.append(_chat_latency(calm))
            counts, found = flood.result(timeout=300)
            flood_s += time.monotonic() - started
            statuses.update(counts)
            errors += found
    idle, busy = statistics.median(unloaded), statistics.median(loaded)
    total = ROUNDS * FLOODERS * FLOOD_REQUESTS
    print(
        f"flood: {total} requests in {ROUNDS} rounds, {flood_s:.1f} s in all, statuses "
        f"{dict(statuses)}; calm key's chat latency median unloaded {idle * 1000:.1f} ms "
        f"({len(unloaded)} requests), during the flood {busy * 1000:.1f} ms "
        f"({len(loaded)} requests), ratio {busy / idle:.2f}"
    )
    assert not errors, errors[:5]
    assert sum(statuses.values()) == total
    # At most a full bucket and what refilled over the test got through.
    admitted = FLOOD_RPM + FLOOD_RPM * (time.monotonic() - test_started) / 60 + 1
    assert statuses[429] >= total - admitted, dict(statuses)
    assert len(loaded) >= 5, f"only {len(loaded)} chat requests during a {flood_s:.1f} s flood"
    assert busy <= 2 * idle, f"chat latency {busy:.3f} s under the flood vs {idle:.3f} s"
    # Nothing crashed: the server still answers.
    assert flood_server.process.poll() is None
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    _chat_latency(calm)


def _upload_stream(n: int) -> Iterator[bytes]:
    """A multipart body carrying UPLOAD_BYTES of batch lines, made as it is sent."""
    boundary = f"upload{n}"
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="big{n}.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    # Lines made by concatenation (fast): 8 clients send 800 MiB between them.
    head = '{"custom_id": "req-'
    middle = (
        '", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", '
        '"messages": [{"role": "user", "content": "'
    )
    tail = '"}]}}\n'
    pad = "y" * (LINE_BYTES - len(head) - 8 - len(middle) - len(tail))
    lines = 256  # per yield: 512 KiB
    for start in range(0, UPLOAD_BYTES // LINE_BYTES, lines):
        yield "".join(
            head + f"{i:08d}" + middle + pad + tail for i in range(start, start + lines)
        ).encode()
    yield f"\r\n--{boundary}--\r\n".encode()


def _upload_length(n: int) -> int:
    head = next(_upload_stream(n))
    return len(head) + UPLOAD_BYTES + len(f"\r\n--upload{n}--\r\n")


@pytest.mark.slow
def test_eight_large_uploads_keep_ingress_memory_bounded(
    serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("batch-uploads")
    # batch_api.max_concurrent_uploads is 8 by default: every upload gets a slot.
    batch_api = {"max_file_bytes": 128 * 1024 * 1024, "max_file_lines": 100_000}
    server = _server(serve_model_dir, root, batch_api)
    try:
        ingress = _ingress_process(server)
        calm = httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {CALM_KEY}"}, timeout=60
        )
        _chat_latency(calm)  # everything loaded before the baseline
        before = ingress.memory_info().rss
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                try:
                    peak[0] = max(peak[0], ingress.memory_info().rss)
                except psutil.Error:
                    return

        results: list[httpx.Response | Exception] = []

        def upload(n: int) -> None:
            try:
                with httpx.Client(base_url=server.base_url, timeout=600) as client:
                    results.append(
                        client.post(
                            "/v1/files",
                            content=_upload_stream(n),
                            headers={
                                "Authorization": f"Bearer {CALM_KEY}",
                                "Content-Type": f"multipart/form-data; boundary=upload{n}",
                                "Content-Length": str(_upload_length(n)),
                            },
                        )
                    )
            except Exception as exc:  # reported below
                results.append(exc)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        clients = [threading.Thread(target=upload, args=(n,)) for n in range(UPLOAD_CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(timeout=540)
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join(timeout=5)
        growth = peak[0] - before
        total = UPLOAD_CLIENTS * UPLOAD_BYTES
        print(
            f"{UPLOAD_CLIENTS} uploads of {UPLOAD_BYTES >> 20} MiB at once in {elapsed:.1f} s: "
            f"ingress RSS before {before / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB, "
            f"growth {growth / 2**20:.0f} MiB ({growth / total:.1%} of the "
            f"{total >> 20} MiB uploaded)"
        )
        assert len(results) == UPLOAD_CLIENTS, "an upload did not finish within 540 s"
        for result in results:
            assert isinstance(result, httpx.Response), result
            assert result.status_code == 200, result.text[:300]
            assert result.json()["bytes"] == UPLOAD_BYTES
        # Streamed: the ingress holds a few MiB per upload (a piece on its way to storage, the
        # line being checked, the custom_ids seen: ~6 MiB for 51,200 lines) and the allocator's
        # slack, never a file: holding one whole file (old: several copies of each) fails.
        assert growth < total / 4, f"ingress grew {growth >> 20} MiB for {total >> 20} MiB"
    finally:
        server.stop()
        (root / "server.log").write_text("".join(server.lines))
