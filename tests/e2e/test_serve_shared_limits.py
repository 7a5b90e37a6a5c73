"""A key's limits hold over two ingress replicas of a real `tokenmill serve`: requests beyond
its requests_per_minute get 429 whichever replica Serve's proxy sends them to, while another
limited key keeps getting 200s (pipeline.serve.access.shared_limits)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.serve_fixtures import ServerProcess, serve_config, start_server

# In the slow set (a server with two ingress replicas: about a minute and a half): the shared
# ledger and its coordinator are checked in tests/unit/test_serve_shared_limits.py, one
# replica's limits end to end in test_serve_keys.py.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BUDGET = 4  # requests per minute of the limited key: one more every 15 s
KEYS = {
    "limited": ("key-limited", {"requests_per_minute": BUDGET}),
    "steady": ("key-steady", {"requests_per_minute": 600}),
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def server(
    serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("serve-shared-limits")
    keys_file = workdir / "keys.yaml"
    entries = [
        {"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest(), "limits": limits}
        for n, (k, limits) in KEYS.items()
    ]
    keys_file.write_text(yaml.safe_dump({"keys": entries}))
    config = serve_config(serve_model_dir)
    config["models"] = [config["models"][0]]  # one engine: the machine has two cores
    config["name"] = "tokenmill-shared-limits"
    # Two ingress replicas in front of the engine (one_hop would put the engine inside).
    config["http"] = {**config["http"], "one_hop": False, "ingress_replicas": 2}
    config["auth"] = {"keys_file": str(keys_file)}
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_server(path, {}, [])
    yield proc
    proc.stop()
    (workdir / "server.log").write_text("".join(proc.lines))


async def wave(
    server: ServerProcess, limited: int, steady: int
) -> list[tuple[str, httpx.Response]]:
    """Concurrent requests of both keys (concurrent, so the proxy spreads them over both
    ingress replicas)."""
    names = ["limited"] * limited + ["steady"] * steady
    async with httpx.AsyncClient(base_url=server.api_url, timeout=60) as client:

        async def one(name: str) -> tuple[str, httpx.Response]:
            headers = {"Authorization": f"Bearer {KEYS[name][0]}"}
            return name, await client.post("/chat/completions", json=CHAT, headers=headers)

        return await asyncio.gather(*(one(n) for n in names))


def test_a_keys_budget_holds_over_two_ingress_replicas(server: ServerProcess) -> None:
    started = time.monotonic()
    results: list[tuple[str, httpx.Response]] = []
    # Three waves, each over the whole budget; between them the replicas' rounds hand idle
    # leases back (the key is contended), so no unit is stranded in either replica.
    for _ in range(3):
        results += asyncio.run(wave(server, limited=3 * BUDGET, steady=4))
        time.sleep(1.5)
    elapsed = time.monotonic() - started
    limited = [r for n, r in results if n == "limited"]
    steady = [r for n, r in results if n == "steady"]
    assert {r.status_code for r in limited} <= {200, 429}
    ok = sum(r.status_code == 200 for r in limited)
    # Exactly the budget, plus what refilled meanwhile (one request per 15 s).
    assert BUDGET <= ok <= BUDGET + int(elapsed * BUDGET / 60), (ok, elapsed)
    for response in limited:
        if response.status_code == 429:
            error = response.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "limited" in error["message"]
            # The key's own bucket: at most 15 s for one request.
            assert 1 <= int(response.headers["retry-after"]) <= 15
    # The other key is not touched by the first one's limit.
    assert [r.status_code for r in steady] == [200] * len(steady)
