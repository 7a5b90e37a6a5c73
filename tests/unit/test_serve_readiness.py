"""The readiness view without Ray: what /ready answers from Serve's status and the replicas'
reports, the board's bookkeeping, and the probe bodies that never name a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pipeline.serve.replicas.board import STALE_AFTER_S, ReplicaBoard
from pipeline.serve.replicas.readiness import ReadinessView, ReplicaReport, running_by_deployment
from pipeline.serve.spec import INGRESS_DEPLOYMENT, ServeSpec, engine_deployments

STALE = 30.0
TWO = {"a": "engine-a", "b": "engine-b"}  # model -> its engine deployment


def healthy(model: str, replica: str = "r1", age_s: float = 0.5) -> ReplicaReport:
    return ReplicaReport(model, replica, age_s, None)


def failed(model: str, replica: str = "r1", age_s: float = 0.1) -> ReplicaReport:
    return ReplicaReport(model, replica, age_s, "engine dead: step loop crashed")


def deployments(*models: str) -> dict[str, str]:
    return {m: f"engine-{m}" for m in models}


def view_of(running: dict[str, int], reports: list[ReplicaReport], models=("a", "b")):
    """A view read at t=100; `running` per model, as Serve counts its deployment's replicas."""
    view = ReadinessView(deployments(*models), STALE)
    view.set_running({f"engine-{m}": n for m, n in running.items()}, at=100.0)
    view.set_reports(reports, at=100.0)
    return view


def test_nothing_is_ready_before_both_sources_were_read() -> None:
    view = ReadinessView(deployments("a"), STALE)
    assert not view.current(0.0).ready and view.current(0.0).age_s is None
    view.set_running({"engine-a": 1}, at=1.0)
    assert not view.current(1.0).ready  # no report read yet
    view.set_reports([healthy("a")], at=1.2)
    readiness = view.current(1.5)
    assert readiness.ready and readiness.age_s == pytest.approx(0.5)  # the older source


def test_ready_needs_a_running_replica_and_a_healthy_report_per_model() -> None:
    view = view_of({"a": 1, "b": 2}, [healthy("a"), healthy("b", "r2")])
    readiness = view.current(100.1)
    assert readiness.ready
    assert (readiness.models, readiness.models_serving, readiness.unserved) == (2, 2, ())


def test_a_failed_engine_is_not_serving_while_serve_still_counts_its_replica() -> None:
    # Serve's controller acts after 3 failed health checks; the replica's report is at once.
    readiness = view_of({"a": 1, "b": 1}, [failed("a"), healthy("b", "r2")]).current(100.1)
    assert not readiness.ready
    assert (readiness.models_serving, readiness.unserved) == (1, ("a",))


def test_one_healthy_replica_of_several_is_enough() -> None:
    reports = [failed("a", "r1"), healthy("a", "r2"), healthy("b", "r3")]
    assert view_of({"a": 2, "b": 1}, reports).current(100.1).ready


def test_a_healthy_report_without_a_running_replica_is_not_serving() -> None:
    # The replica's process died (its last report lingers), or the new replica posted from
    # its first health check and Serve does not route to it yet.
    readiness = view_of({"a": 0, "b": 1}, [healthy("a"), healthy("b")]).current(100.1)
    assert readiness.unserved == ("a",)
    assert view_of({"b": 1}, [healthy("a"), healthy("b")]).current(100.1).unserved == ("a",)


def test_reports_go_stale_counting_the_time_since_they_were_read() -> None:
    view = view_of({"a": 1}, [healthy("a", age_s=STALE - 5)], models=("a",))
    assert view.current(100.0 + 4).ready
    late = view.current(100.0 + 6)  # no read since: the report is older than it was
    assert not late.ready and late.age_s == pytest.approx(6)


def test_a_new_read_replaces_the_old_one_whole() -> None:
    view = view_of({"a": 1}, [failed("a")], models=("a",))
    assert not view.current(100.1).ready
    view.set_reports([failed("a", "old"), healthy("a", "new")], at=101.0)
    assert view.current(101.1).ready
    view.set_running({"engine-a": 0}, at=102.0)
    assert not view.current(102.1).ready


def test_the_bodies_carry_counts_and_age_never_model_names() -> None:
    names = ("org/secret-model-7b", "internal-finetune")
    view = view_of({n: 1 for n in names}, [healthy(names[0]), failed(names[1])], models=names)
    readiness = view.current(100.25)
    body = readiness.body()
    assert body == {"status": "unavailable", "models": 2, "models_serving": 1, "age_s": 0.25}
    assert not any(name in json.dumps(body) for name in names)
    assert readiness.unserved == ("internal-finetune",)  # for the probe's log only
    assert ReadinessView(deployments(*names), STALE).current(0.0).body() == {
        "status": "unavailable",
        "models": 2,
        "models_serving": 0,
        "age_s": None,
    }


# --- Serve's status ---------------------------------------------------------------------------


def serve_status(app: str, replica_states: dict[str, dict[str, int]]) -> SimpleNamespace:
    deployments = {d: SimpleNamespace(replica_states=s) for d, s in replica_states.items()}
    return SimpleNamespace(applications={app: SimpleNamespace(deployments=deployments)})


def test_running_replicas_are_read_per_deployment_from_serve_status() -> None:
    status = serve_status("app", {"engine-a": {"RUNNING": 1}, "engine-b": {"RUNNING": 2}})
    assert running_by_deployment(status, "app") == {"engine-a": 1, "engine-b": 2}
    replacing = serve_status(
        "app", {"engine-a": {"STOPPING": 1, "STARTING": 1}, "engine-b": {"RUNNING": 1}}
    )
    assert running_by_deployment(replacing, "app") == {"engine-a": 0, "engine-b": 1}
    assert running_by_deployment(serve_status("other", {}), "app") == {}
    view = ReadinessView(TWO, STALE)
    view.set_running(running_by_deployment(replacing, "app"), at=0.0)
    view.set_reports([healthy("a"), healthy("b")], at=0.0)
    assert view.current(0.1).unserved == ("a",)


def test_the_engine_deployment_of_each_model() -> None:
    model = {"model": {"path": "/x"}}
    one = ServeSpec.model_validate({"models": [{"name": "m", **model}]})
    assert engine_deployments(one) == {"m": INGRESS_DEPLOYMENT}  # one_hop: the ingress
    two = ServeSpec.model_validate({"models": [{"name": "a", **model}, {"name": "b", **model}]})
    assert engine_deployments(two) == {"a": "engine-a", "b": "engine-b"}


# --- the board's bookkeeping (the actor's class, called directly) -----------------------------


def board():
    return ReplicaBoard.__ray_actor_class__("app")


def test_the_board_keeps_a_failure_whatever_the_replica_posts_later() -> None:
    b = board()
    b.post("a", "r1", None, "engine dead")
    b.post("a", "r1", None, None)
    b.post("a", "r2", None, None)
    verdicts = {r.replica: r.failure for r in b.reports()}
    assert verdicts == {"r1": "engine dead", "r2": None}


def test_the_board_drops_replicas_that_stopped_posting(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.serve.replicas.board as board_module

    clock = [1000.0]
    monkeypatch.setattr(board_module.time, "monotonic", lambda: clock[0])
    b = board()
    b.post("a", "gone", None, None)
    clock[0] += STALE_AFTER_S - 1
    b.post("a", "here", None, None)
    assert {r.replica: round(r.age_s) for r in b.reports()} == {
        "gone": STALE_AFTER_S - 1,
        "here": 0,
    }
    clock[0] += 2
    assert [r.replica for r in b.reports()] == ["here"]
    assert b.latest() == {}  # no stats posted: nothing for /metrics


def test_a_serve_count_nobody_refreshes_stops_counting() -> None:
    """Fresh replica reports, but Serve's count was last read long ago (its reader stuck or
    dead): that count may describe replicas long gone, so nothing is ready on it."""
    view = view_of({"a": 1}, [healthy("a")], models=("a",))
    assert view.current(100.0 + STALE - 1).ready
    view.set_reports([healthy("a")], at=100.0 + STALE + 5)  # the replicas keep posting
    stale = view.current(100.0 + STALE + 5.1)
    assert not stale.ready and stale.unserved == ("a",)
    view.set_running({"engine-a": 1}, at=100.0 + STALE + 6)
    assert view.current(100.0 + STALE + 6.1).ready


def test_the_board_restarts_a_status_watcher_that_died(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's status watcher is a thread of the board: one that died (an error it did not
    expect) is started again by the next snapshot, not trusted to still be watching."""
    import threading

    board_cls = ReplicaBoard.__ray_metadata__.modified_class
    instance = board_cls("app")
    starts: list[int] = []

    def watch(self: object) -> None:
        starts.append(1)  # returns at once: the thread is dead

    monkeypatch.setattr(board_cls, "_watch_serve", watch)
    instance.snapshot()
    instance._watcher.join(5)
    instance.snapshot()
    instance._watcher.join(5)
    assert len(starts) == 2 and isinstance(instance._watcher, threading.Thread)
