"""Self-healing replicas and probes against a real `tokenmill serve`: break the engine's step
loop in the only replica (the TOKENMILL_TEST_HOOKS debug route; one model, so http.one_hop:
the engine lives in the ingress replica, and while it is replaced there is no ingress at all),
then check that

- requests in flight get 503 in OpenAI's error shape, and every later request ends in 200 or
  503 (none hangs) until a new replica (a new `x-tokenmill-replica`) serves;
- /ready and /health, probed all along as a kubelet would (a new connection each, a 1 s
  timeout), answer every time and fast: /ready turns 503 soon after the break and 200 again
  once the new replica serves; /health stays 200; neither names a model.

Health checks run every second here. The default suite breaks each mode once; the `slow` test
repeats both five times and prints the numbers (docs/serve.md, Probes).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.e2e import serve_fixtures
from tests.e2e.serve_fixtures import API_KEY, ServerProcess, serve_config, start_server

pytestmark = pytest.mark.timeout(900)

CHECK_PERIOD_S = 1.0
STALL_TIMEOUT_S = 3.0
SHUTDOWN_S = 5.0
SERVE_FAILED_CHECKS = 3  # Serve replaces a replica after this many failed checks in a row
MODES = ("crash", "stall")  # how the test hook breaks an engine
CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]

# What a kubelet does by default: a new connection per probe, 1 s to answer.
PROBE_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.05
PROBER_START_S = 60  # a hang guard for the prober's own process (it imports httpx)
# The targets: probes answered from memory, a crash seen by /ready at once.
PROBE_P99_TARGET_S = 0.1
READY_503_AFTER_CRASH_S = 2.0
# A loaded machine slows everything, probes included: the p99 bound is the target or this
# multiple of the p99 measured on the same server before the break, whichever is larger.
PROBE_P99_SLOWDOWN = 3.0


def health_config(model_dir: Path) -> dict:
    config = serve_config(model_dir)
    tiny = config["models"][0]
    tiny["replicas"] = {"cpus_per_replica": 0.25, "min_replicas": 1, "max_replicas": 1}
    tiny["health"] = {
        "check_period_s": CHECK_PERIOD_S,
        "check_timeout_s": 10,
        "stall_timeout_s": STALL_TIMEOUT_S,
        "graceful_shutdown_timeout_s": SHUTDOWN_S,
    }
    config["models"] = [tiny]  # one engine: the test's machine has two cores
    return config


@dataclass
class Server:
    process: ServerProcess
    startup_s: float  # measured: `tokenmill serve` to serving, one replica start included

    @property
    def base_url(self) -> str:
        return self.process.base_url

    def replace_deadline_s(self, mode: str) -> float:
        """Break to the first answer of a new replica: the failure seen (a stall only after
        stall_timeout_s), Serve's failed checks, the old replica's shutdown, and a replica
        start, which this machine's own start-up measured (twice it, for a loaded moment)."""
        seen = STALL_TIMEOUT_S + CHECK_PERIOD_S if mode == "stall" else 0.0
        return seen + SERVE_FAILED_CHECKS * CHECK_PERIOD_S + SHUTDOWN_S + 2 * self.startup_s


@pytest.fixture(scope="module")
def server(serve_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve-health") / "serve.yaml"
    config.write_text(yaml.safe_dump(health_config(serve_model_dir)))
    env = {"TOKENMILL_API_KEYS": API_KEY, "TOKENMILL_TEST_HOOKS": "1"}
    started = time.monotonic()
    proc = start_server(config, env, [])
    yield Server(proc, time.monotonic() - started)
    proc.stop()
    (config.parent / "server.log").write_text("".join(proc.lines))


def chat_client(server: Server, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.process.api_url, api_key=API_KEY, max_retries=0, timeout=timeout_s
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


def wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(server.base_url + "/ready", timeout=PROBE_TIMEOUT_S).status_code != 200:
        assert time.monotonic() < deadline, f"/ready stayed 503 for {timeout_s:.0f} s"
        time.sleep(0.2)


# --- probing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    path: str
    sent: float  # monotonic (system-wide: comparable across processes)
    latency_s: float
    status: int | None  # None: no answer (timed out, or the connection failed)
    body: dict | None

    @property
    def answered(self) -> bool:
        """As a kubelet counts it: an answer, all of it within PROBE_TIMEOUT_S."""
        return self.status is not None and self.latency_s <= PROBE_TIMEOUT_S


def probe_until(base_url: str, started: Event, stop: Event, out: Connection) -> None:
    """The prober process: /ready and /health in turn until `stop`, then every probe to `out`.
    A new connection per probe, as a kubelet makes."""
    probes: list[Probe] = []
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=PROBE_TIMEOUT_S, limits=limits) as http:
        started.set()
        while not stop.is_set():
            for path in ("/ready", "/health"):
                sent = time.monotonic()
                try:
                    response = http.get(base_url + path)
                except httpx.HTTPError:
                    probes.append(Probe(path, sent, time.monotonic() - sent, None, None))
                    continue
                latency = time.monotonic() - sent
                probes.append(Probe(path, sent, latency, response.status_code, response.json()))
            stop.wait(PROBE_INTERVAL_S)
    out.send(probes)


@dataclass
class Prober:
    """Probes /ready and /health from a process of its own while the block runs (as a
    kubelet does: the test's own threads never hold a probe up)."""

    base_url: str
    probes: list[Probe] = field(default_factory=list)

    def __enter__(self) -> Prober:
        context = multiprocessing.get_context("spawn")
        self._started, self._stop = context.Event(), context.Event()
        self._results, sender = context.Pipe(duplex=False)
        args = (self.base_url, self._started, self._stop, sender)
        self._process = context.Process(target=probe_until, args=args, daemon=True)
        self._process.start()
        assert self._started.wait(PROBER_START_S), f"the prober did not start in {PROBER_START_S} s"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._results.poll(PROBER_START_S), "the prober sent no results"
        self.probes = self._results.recv()
        self._process.join(timeout=PROBER_START_S)

    def ready_statuses(self, since: float) -> list[tuple[float, int | None]]:
        return [(p.sent, p.status) for p in self.probes if p.path == "/ready" and p.sent >= since]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def baseline_probe_p99(server: Server, seconds: float = 2.0) -> float:
    with Prober(server.base_url) as prober:
        time.sleep(seconds)
    assert all(p.answered for p in prober.probes), "a probe went unanswered before any break"
    return p99([p.latency_s for p in prober.probes])


# --- breaking a replica ----------------------------------------------------------------------


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

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), f"a request in flight hung past {timeout_s:.0f} s"


def break_engine(server: Server, mode: str) -> str:
    response = httpx.post(
        f"{server.base_url}/debug/break-engine/tiny",
        params={"mode": mode},
        headers=auth(),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()["replica"]


def until_replaced(client: openai.OpenAI, old: str, deadline_s: float) -> str:
    """Chats until one is served by another replica; each ends in 200 or 503 (the client's
    timeout is the deadline: none may hang). Returns the new replica's id."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            replica = served_by(client)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            assert exc.body["code"] == "engine_unavailable"
            time.sleep(0.2)
            continue
        if replica != old:
            return replica
        time.sleep(0.2)
    raise AssertionError(f"replica {old} was not replaced within {deadline_s:.0f} s")


@dataclass(frozen=True)
class Outcome:
    """One break-and-replace, measured from the break."""

    mode: str
    ready_503_s: float  # the first /ready 503
    new_replica_s: float  # the first 200 from a new replica
    ready_again_s: float  # /ready 200 again
    probes: int
    latencies_s: list[float]
    slowest_at_s: float  # when the slowest probe was sent

    def line(self) -> str:
        ms = sorted(1000 * s for s in self.latencies_s)
        return (
            f"{self.mode}: /ready 503 after {self.ready_503_s:.2f} s, first 200 from a new "
            f"replica after {self.new_replica_s:.1f} s, /ready 200 again after "
            f"{self.ready_again_s:.1f} s; {self.probes} probes, latency p50 "
            f"{statistics.median(ms):.1f} ms, p99 {p99(ms):.1f} ms, max {ms[-1]:.1f} ms "
            f"(sent at +{self.slowest_at_s:.1f} s)"
        )


def break_and_replace(server: Server, mode: str, p99_bound_s: float) -> Outcome:
    """Break the only replica's engine while probing, wait for its replacement, and check
    the requests and the probes; returns the measurements."""
    deadline_s = server.replace_deadline_s(mode)
    client = chat_client(server, timeout_s=deadline_s)
    wait_ready(server, deadline_s)
    old = served_by(client)
    with Prober(server.base_url) as prober:
        streamed = InFlight(client, stream=True)
        whole = InFlight(client, stream=False)
        assert streamed.started.wait(deadline_s) and whole.started.wait(deadline_s)
        time.sleep(0.5)  # both are in the engine now

        broken_at = time.monotonic()
        assert break_engine(server, mode) == old
        streamed.join(deadline_s)
        whole.join(deadline_s)
        # In flight on the broken replica: 503 (whole) or an in-band error event (streamed),
        # never a truncated answer passed off as finished.
        assert (whole.status, whole.outcome) == (503, "engine_unavailable")
        assert (streamed.status, streamed.outcome) == (200, "engine_unavailable")

        new = until_replaced(client, old, deadline_s)
        new_replica_s = time.monotonic() - broken_at
        wait_ready(server, deadline_s)
        ready_again_s = time.monotonic() - broken_at
        assert served_by(client) == new  # the new replica serves from now on
        time.sleep(0.5)  # a few probes after

    probes = [p for p in prober.probes if p.sent >= broken_at]
    unanswered = [p for p in probes if not p.answered]
    assert not unanswered, (
        f"{len(unanswered)} of {len(probes)} probes got no answer within {PROBE_TIMEOUT_S} s, "
        f"first: {unanswered[0].path} at +{unanswered[0].sent - broken_at:.2f} s"
    )
    assert {p.status for p in probes if p.path == "/health"} == {200}
    assert {p.status for p in probes if p.path == "/ready"} == {200, 503}
    for p in probes:  # counts and a status, never a model's name
        assert "tiny" not in str(p.body), p.body
    latencies = [p.latency_s for p in probes]
    assert p99(latencies) < p99_bound_s, (
        f"probe p99 {1000 * p99(latencies):.0f} ms over {len(probes)} probes is above "
        f"{1000 * p99_bound_s:.0f} ms (the larger of the target and {PROBE_P99_SLOWDOWN:g}x "
        "the p99 before the break)"
    )

    # /ready: 200 until the failure is seen, 503 until the new replica serves, then 200.
    ready = prober.ready_statuses(since=broken_at)
    first_503 = next(t for t, status in ready if status == 503) - broken_at
    seen_bound = READY_503_AFTER_CRASH_S
    if mode == "stall":  # the health check calls a stall after stall_timeout_s
        seen_bound += STALL_TIMEOUT_S + CHECK_PERIOD_S
    assert first_503 < seen_bound, (
        f"/ready turned 503 {first_503:.2f} s after the {mode}, above {seen_bound:g} s"
    )
    after = [status for t, status in ready if t - broken_at >= first_503]
    flips = sum(1 for a, b in itertools.pairwise(after) if a != b)
    assert flips == 1 and after[-1] == 200, f"/ready after the first 503: {after}"
    slowest = max(probes, key=lambda p: p.latency_s)
    return Outcome(
        mode,
        first_503,
        new_replica_s,
        ready_again_s,
        len(probes),
        latencies,
        slowest.sent - broken_at,
    )


# The stall (50 s more) is slow: by default the stall watch is tests/unit/test_serve_health.py's
# and test_engine_health.py's, a hung engine process's tests/unit/test_process_engine.py's, and
# the replacement path the crash's.
@pytest.mark.parametrize("mode", ["crash", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_broken_replica_is_replaced_and_the_probes_answer_throughout(
    server: Server, mode: str
) -> None:
    wait_ready(server, server.replace_deadline_s(mode))
    bound = max(PROBE_P99_TARGET_S, PROBE_P99_SLOWDOWN * baseline_probe_p99(server))
    print(break_and_replace(server, mode, bound).line())


def engine_processes(server: Server) -> list[int]:
    """Pids of the engine processes (engines/process.py children) this server runs: below its
    own process (Ray's raylet, the replica's worker, then the engine), never another's."""
    import psutil

    pids = []
    for child in psutil.Process(server.process.process.pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # gone meanwhile
        if "-m" in argv and "engines.process" in argv:
            pids.append(child.pid)
    return pids


def test_an_idle_engine_process_killed_is_seen_by_the_health_check(server: Server) -> None:
    """SIGKILL of the replica's idle engine process (what the OOM killer does): with no request
    to trip over it, the health check itself sees it within one period, /ready turns 503, the
    replica is replaced, and the official client's next requests are served."""
    deadline_s = server.replace_deadline_s("crash")
    client = chat_client(server, timeout_s=deadline_s)
    wait_ready(server, deadline_s)
    old = served_by(client)
    (pid,) = engine_processes(server)  # one replica, its engine in a process of its own
    time.sleep(0.5)  # idle: nothing in flight
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # No request is sent until /ready has told: only the health check can see the death. It
    # runs every CHECK_PERIOD_S; on a loaded machine Serve may start one late, so a few
    # periods are allowed (a dead engine that only a request reveals would never turn it).
    bound = 3 * CHECK_PERIOD_S + READY_503_AFTER_CRASH_S
    while True:
        try:
            status = httpx.get(server.base_url + "/ready", timeout=PROBE_TIMEOUT_S).status_code
        except httpx.HTTPError:
            status = None  # a probe the loaded machine did not answer in time: ask again
        if status == 503:
            break
        waited = time.monotonic() - killed_at
        assert waited < bound, f"/ready stayed 200 {waited:.1f} s after the engine process died"
        time.sleep(0.05)
    print(f"/ready 503 {time.monotonic() - killed_at:.2f} s after the engine process was killed")
    new = until_replaced(client, old, deadline_s)
    wait_ready(server, deadline_s)
    assert served_by(client) == new
    assert engine_processes(server) != [pid]


@pytest.mark.slow
def test_five_breaks_of_each_kind(server: Server) -> None:
    """The numbers behind docs/serve.md's Probes section: five crashes and five stalls."""
    wait_ready(server, server.replace_deadline_s("stall"))
    bound = max(PROBE_P99_TARGET_S, PROBE_P99_SLOWDOWN * baseline_probe_p99(server))
    outcomes = [break_and_replace(server, mode, bound) for _ in range(5) for mode in MODES]
    for outcome in outcomes:
        print(outcome.line())
    for mode in MODES:
        runs = [o for o in outcomes if o.mode == mode]
        print(Outcome(f"{mode} x{len(runs)}", *summary(runs)).line())


def summary(runs: list[Outcome]) -> tuple[float, float, float, int, list[float], float]:
    """The worst of each measure over `runs`, and every probe's latency."""
    slowest = max(runs, key=lambda o: max(o.latencies_s))
    return (
        max(o.ready_503_s for o in runs),
        max(o.new_replica_s for o in runs),
        max(o.ready_again_s for o in runs),
        sum(o.probes for o in runs),
        [s for o in runs for s in o.latencies_s],
        slowest.slowest_at_s,
    )


def test_the_probes_are_plain_and_name_no_model(server: Server) -> None:
    wait_ready(server, server.replace_deadline_s("crash"))
    health = httpx.get(server.base_url + "/health", timeout=PROBE_TIMEOUT_S)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = httpx.get(server.base_url + "/ready", timeout=PROBE_TIMEOUT_S).json()
    assert ready["status"] == "ready" and (ready["models"], ready["models_serving"]) == (1, 1)
    assert 0 <= ready["age_s"] < 5  # refreshed in the background, a fraction of a second ago
    assert set(ready) == {"status", "models", "models_serving", "age_s"}
    # Only the probe routes themselves: a path below one is not a probe.
    below = httpx.get(server.base_url + "/ready/tiny", timeout=PROBE_TIMEOUT_S)
    assert below.status_code == 404 and below.json()["error"]["code"] == "not_found"
