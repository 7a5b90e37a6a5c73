"""Self-healing replicas against a real `tokenmill serve`: break the engine's step loop in the
only replica (the TOKENMILL_TEST_HOOKS debug route), then check that requests in flight get
503 in OpenAI's error shape, that Serve replaces the replica (a new `x-tokenmill-replica`),
that /ready says so, and that later requests succeed. Every request has a client timeout and
must end in 200 or 503: none may hang.

Health checks run every second here, so a broken replica is replaced within seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.e2e import serve_fixtures
from tests.e2e.serve_fixtures import API_KEY, ServerProcess, serve_config, start_server

serve_model_dir = serve_fixtures.serve_model_dir

pytestmark = pytest.mark.timeout(600)

CLIENT_TIMEOUT_S = 60  # far above any answer here: a request that hits it has hung
REPLACE_TIMEOUT_S = 120
CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]


def health_config(model_dir: Path) -> dict:
    config = serve_config(model_dir)
    tiny = config["models"][0]
    tiny["replicas"] = {"cpus_per_replica": 0.25, "min_replicas": 1, "max_replicas": 1}
    tiny["health"] = {
        "check_period_s": 1,
        "check_timeout_s": 10,
        "stall_timeout_s": 3,
        "graceful_shutdown_timeout_s": 5,
    }
    config["models"] = [tiny]  # one engine: the test's machine has two cores
    return config


@pytest.fixture(scope="module")
def server(
    serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("serve-health") / "serve.yaml"
    config.write_text(yaml.safe_dump(health_config(serve_model_dir)))
    env = {"TOKENMILL_API_KEYS": API_KEY, "TOKENMILL_TEST_HOOKS": "1"}
    proc = start_server(config, env, [])
    yield proc
    proc.stop()
    (config.parent / "server.log").write_text("".join(proc.lines))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def served_by(client: openai.OpenAI) -> str:
    """One short chat; the id of the replica that answered it (200 required)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT, max_tokens=4
    )
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    return raw.headers["x-tokenmill-replica"]


def wait_ready(server: ServerProcess, timeout: float = REPLACE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(server.base_url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/ready stayed 503"
        time.sleep(0.2)


class InFlight:
    """A long request (streamed or whole) running in a thread; outcome: its error code."""

    def __init__(self, client: openai.OpenAI, stream: bool) -> None:
        self.started = threading.Event()  # the stream's first content arrived
        self.outcome: str | None = None  # "completed", or the error code it ended with
        self.status: int | None = None
        self._client, self._stream = client, stream
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {
            "model": "tiny",
            "messages": CHAT,
            "max_tokens": serve_fixtures.MAX_TOKENS_CAP,
            "extra_body": {"ignore_eos": True},
        }
        try:
            if self._stream:
                for chunk in self._client.chat.completions.create(**body, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.started.set()
            else:
                self.started.set()
                self._client.chat.completions.create(**body)
            self.outcome = "completed"
        except openai.APIStatusError as exc:  # a 503 answer
            self.status = exc.status_code
            self.outcome = exc.body.get("code") if isinstance(exc.body, dict) else str(exc.body)
        except openai.APIError as exc:  # an error event inside a 200 stream
            self.status = 200
            self.outcome = exc.body.get("code") if isinstance(exc.body, dict) else str(exc.body)
        finally:
            self.started.set()

    def join(self) -> None:
        self._thread.join(timeout=CLIENT_TIMEOUT_S + 10)
        assert not self._thread.is_alive(), "request hung"


def break_engine(server: ServerProcess, mode: str) -> str:
    response = httpx.post(
        f"{server.base_url}/debug/break-engine/tiny",
        params={"mode": mode},
        headers=auth(),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()["replica"]


def until_replaced(server: ServerProcess, client: openai.OpenAI, old: str) -> tuple[str, bool]:
    """Requests until one is served by another replica; each gets 200 or 503, none hangs.
    Returns the new replica id and whether /ready was ever seen at 503 meanwhile."""
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    saw_unready = False
    while time.monotonic() < deadline:
        if httpx.get(server.base_url + "/ready", timeout=10).status_code == 503:
            saw_unready = True
        try:
            replica = served_by(client)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            assert exc.body["code"] == "engine_unavailable"
            time.sleep(0.2)
            continue
        if replica != old:
            return replica, saw_unready
        time.sleep(0.2)
    raise AssertionError(f"replica {old} was not replaced within {REPLACE_TIMEOUT_S}s")


@pytest.mark.parametrize("mode", ["crash", "stall"])
def test_a_broken_replica_is_replaced(
    server: ServerProcess, client: openai.OpenAI, mode: str
) -> None:
    wait_ready(server)
    old = served_by(client)
    streamed = InFlight(client, stream=True)
    whole = InFlight(client, stream=False)
    assert streamed.started.wait(CLIENT_TIMEOUT_S) and whole.started.wait(CLIENT_TIMEOUT_S)
    time.sleep(0.5)  # both are in the engine now

    broken_at = time.monotonic()
    assert break_engine(server, mode) == old
    streamed.join()
    whole.join()
    # In flight on the broken replica: 503 (whole) or an in-band error event (streamed),
    # never a truncated answer passed off as finished.
    assert (whole.status, whole.outcome) == (503, "engine_unavailable")
    assert (streamed.status, streamed.outcome) == (200, "engine_unavailable")

    new, saw_unready = until_replaced(server, client, old)
    replaced_after = time.monotonic() - broken_at
    wait_ready(server)
    assert served_by(client) == new  # the new replica serves from now on
    print(f"{mode}: replaced after {replaced_after:.1f}s, /ready 503 seen: {saw_unready}")


def test_health_and_ready_are_plain_and_call_no_engine(server: ServerProcess) -> None:
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": ["tiny"]}
    wait_ready(server)
    assert httpx.get(server.base_url + "/ready", timeout=10).json()["status"] == "ready"
