"""Replica health without Ray: stall detection, the sticky verdict, the graceful-shutdown
default, Serve's health options (one-hop included), and a replica failing its in-flight calls
and posting its failure at once when its engine stalls or dies (the replica class run directly
on an event loop, with a fake engine and a fake board)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from engines.api import (
    EngineDeadError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
)
from engines.health import StallWatch
from pipeline.serve.gateway import result_error
from pipeline.serve.replicas.health import ReplicaHealth, ReplicaUnhealthyError
from pipeline.serve.spec import (
    HealthSpec,
    ServedModelSpec,
    ServeSpec,
    engine_deployment_options,
    one_hop_deployment_options,
)


def stats(steps: int, running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(running, waiting, 0, 0, 100, 10 * running, steps)


# --- stall detection -------------------------------------------------------------------------


def test_idle_engine_never_stalls() -> None:
    watch = StallWatch(stall_timeout_s=10)
    for t in range(0, 1000, 50):
        assert watch.observe(stats(steps=7), now=float(t)) is None


def test_progressing_engine_never_stalls() -> None:
    watch = StallWatch(stall_timeout_s=10)
    for i, t in enumerate(range(0, 1000, 50)):
        assert watch.observe(stats(steps=i, running=3), now=float(t)) is None


def test_busy_engine_without_steps_stalls_after_the_timeout() -> None:
    watch = StallWatch(stall_timeout_s=10)
    assert watch.observe(stats(steps=5, running=1, waiting=2), now=100.0) is None
    assert watch.observe(stats(steps=5, running=1, waiting=2), now=109.0) is None
    reason = watch.observe(stats(steps=5, running=1, waiting=2), now=110.5)
    assert reason is not None and "stalled" in reason and "1 running and 2 waiting" in reason


def test_the_stall_clock_starts_when_work_arrives() -> None:
    watch = StallWatch(stall_timeout_s=10)
    watch.observe(stats(steps=5), now=0.0)  # idle for a long time, then a request arrives
    assert watch.observe(stats(steps=5, waiting=1), now=500.0) is None
    assert watch.observe(stats(steps=5, waiting=1), now=505.0) is None
    assert watch.observe(stats(steps=5, waiting=1), now=511.0) is not None


def test_a_failure_is_sticky() -> None:
    health = ReplicaHealth(StallWatch(stall_timeout_s=1))
    health.check(stats(steps=1, running=1), now=0.0)
    health.check(stats(steps=1, running=1), now=2.0)
    assert health.failure is not None
    health.check(stats(steps=2, running=1), now=3.0)  # the loop moved again: still replaced
    with pytest.raises(ReplicaUnhealthyError, match="stalled"):
        health.raise_if_failed()


def test_unreadable_stats_mean_unhealthy() -> None:
    health = ReplicaHealth(StallWatch(stall_timeout_s=1))
    health.check(None, now=0.0, error="EngineDeadError: gone")
    with pytest.raises(ReplicaUnhealthyError, match="gone"):
        health.raise_if_failed()


# --- graceful shutdown and Serve options ------------------------------------------------------


def test_graceful_shutdown_default_covers_the_longest_generation() -> None:
    health = HealthSpec()
    # max_tokens / 10 tokens/s + 30 s margin, at least 60 s.
    assert health.shutdown_timeout_s(1024) == pytest.approx(1024 / 10 + 30)
    assert health.shutdown_timeout_s(16) == 60
    slow = HealthSpec(shutdown_decode_tokens_per_s=2)
    assert slow.shutdown_timeout_s(1024) == pytest.approx(512 + 30)
    assert HealthSpec(graceful_shutdown_timeout_s=7).shutdown_timeout_s(100_000) == 7


def test_health_settings_become_serve_options() -> None:
    served = ServedModelSpec.model_validate(
        {
            "name": "m",
            "model": {"path": "/x"},
            "limits": {"max_tokens": 4000, "default_max_tokens": 16},
            "health": {"check_period_s": 2, "check_timeout_s": 5},
        }
    )
    options = engine_deployment_options(served)
    assert options["health_check_period_s"] == 2
    assert options["health_check_timeout_s"] == 5
    assert options["graceful_shutdown_timeout_s"] == pytest.approx(4000 / 10 + 30)


def test_one_hop_takes_its_health_checks_from_the_model_s_health_section() -> None:
    # With one_hop the ingress deployment holds the engine: its checks are the engine's.
    spec = ServeSpec.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "model": {"path": "/x"},
                    "health": {"check_period_s": 1, "check_timeout_s": 4},
                }
            ]
        }
    )
    assert spec.one_hop
    options = one_hop_deployment_options(spec)
    assert (options["health_check_period_s"], options["health_check_timeout_s"]) == (1, 4)


def test_health_section_is_strict() -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        ServedModelSpec.model_validate(
            {"name": "m", "model": {"path": "/x"}, "health": {"stall_timeout": 5}}
        )


# --- results that are errors ------------------------------------------------------------------


def result(reason: str, error: str | None = None) -> GenerationResult:
    request = GenerationRequest(prompt_token_ids=[1, 2])
    return GenerationResult.without_output(request, reason, error=error)  # type: ignore[arg-type]


def test_an_engine_cancelled_result_is_a_503_not_a_stop() -> None:
    cancelled = result_error("m", result("cancelled"))
    assert cancelled is not None and cancelled.status == 503
    assert cancelled.body()["error"]["code"] == "engine_unavailable"
    failed = result_error("m", result("error", error="boom"))
    assert failed is not None and failed.status == 500
    assert result_error("m", result("stop")) is None
    assert result_error("m", result("length")) is None


# --- the replica with a stalled or dead engine ------------------------------------------------


@dataclass
class FakeEngine:
    """An engine whose step loop never steps: requests wait forever, stats stay flat."""

    dead: bool = False
    waiting: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    info: EngineInfo = field(
        default_factory=lambda: EngineInfo("fake", "m", 64, "cpu", 1, "float32", False)
    )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.dead:
            raise EngineDeadError("the fake engine stopped")
        self.waiting.append(request.request_id)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return stats(steps=3, waiting=len(self.waiting))

    def drain_step_records(self) -> list:
        return []

    def shutdown(self) -> None:
        pass


class FakeBoard:
    """Records what the replica posts: (monotonic time, failure)."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, str | None]] = []
        self.post = SimpleNamespace(remote=self._post)

    def _post(self, model: str, replica: str, stats, failure: str | None = None):
        self.posts.append((time.monotonic(), failure))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def failures(self) -> list[float]:
        return [at for at, failure in self.posts if failure is not None]


def make_replica(
    monkeypatch: pytest.MonkeyPatch, engine: FakeEngine, board: FakeBoard | None = None
):
    from pipeline.serve.replicas.replica import EngineReplica
    from pipeline.spec import StorageSpec

    monkeypatch.setitem(
        EngineReplica.func_or_class.__init__.__globals__, "open_engine", lambda *a, **k: engine
    )
    served = ServedModelSpec.model_validate(
        {"name": "m", "model": {"path": "/x"}, "health": {"stall_timeout_s": 0.2}}
    )
    # The class under Serve's decorator, run directly: no Ray.
    replica = EngineReplica.func_or_class(served, StorageSpec())
    replica._board = board  # what the poster would have opened in Ray
    return replica


async def stop_poster(replica) -> None:
    if replica._poster is not None:
        replica._poster.cancel()
        await asyncio.wait((replica._poster,))


def test_a_stalled_replica_fails_its_requests_and_its_health_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine()
    replica = make_replica(monkeypatch, engine)

    async def scenario() -> None:
        request = GenerationRequest(prompt_token_ids=[1, 2, 3])
        call = asyncio.ensure_future(replica.generate(request))
        await asyncio.sleep(0.05)
        await replica.check_health()  # work waiting, clock starts: healthy
        await asyncio.sleep(0.3)
        with pytest.raises(ReplicaUnhealthyError, match="stalled"):
            await replica.check_health()
        # The request in flight fails at once instead of waiting for a step.
        with pytest.raises(ReplicaUnhealthyError):
            await asyncio.wait_for(call, timeout=2)
        assert request.request_id in engine.aborted
        # New requests are refused until Serve replaces the replica.
        with pytest.raises(ReplicaUnhealthyError):
            await replica.generate(GenerationRequest(prompt_token_ids=[1]))
        await stop_poster(replica)

    asyncio.run(scenario())


def test_a_dead_engine_seen_by_a_request_makes_the_replica_unhealthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine(dead=True)
    replica = make_replica(monkeypatch, engine)

    async def scenario() -> None:
        with pytest.raises(EngineDeadError):
            await replica.generate(GenerationRequest(prompt_token_ids=[1]))
        with pytest.raises(ReplicaUnhealthyError, match="engine dead"):
            await replica.check_health()
        await stop_poster(replica)

    asyncio.run(scenario())


def test_a_replica_posts_healthy_at_its_first_check_and_a_failure_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.serve.replicas.replica import HEARTBEAT_S, SETTLE_S

    engine, board = FakeEngine(), FakeBoard()
    replica = make_replica(monkeypatch, engine, board)

    async def until(condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what} within {timeout} s"
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        # Serve's first health check runs before the replica is routed to: it posts then.
        await replica.check_health()
        await until(lambda: board.posts, "the first post", timeout=HEARTBEAT_S / 2)
        assert board.posts[0][1] is None
        # A request meets a dead engine: the failure goes out now, not at the next heartbeat
        # nor after Serve's health checks.
        engine.dead = True
        seen = time.monotonic()
        with pytest.raises(EngineDeadError):
            await replica.generate(GenerationRequest(prompt_token_ids=[1]))
        await until(board.failures, "the failure's post", timeout=HEARTBEAT_S / 2)
        # The settle pause plus scheduling: far below a heartbeat (the bound is the contract,
        # the settle pause what the poster waits on purpose).
        assert board.failures()[0] - seen < SETTLE_S + 1.0
        await stop_poster(replica)

    asyncio.run(scenario())


def test_test_hooks_are_off_without_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.serve.replicas.testhooks import break_engine

    monkeypatch.delenv("TOKENMILL_TEST_HOOKS", raising=False)
    engine = SimpleNamespace(runner=SimpleNamespace(execute=lambda: "ok"))
    with pytest.raises(PermissionError):
        break_engine(engine, "crash")
    assert engine.runner.execute() == "ok"
