"""`tokenmill submit` without a cluster: ids, the submit/attach/retry decision, credentials,
auth tokens, the entrypoint, and the whole flow against a fake Jobs API client."""

from __future__ import annotations

import io
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from pipeline import submit as sub
from pipeline.spec import load_job_spec

JOB_YAML = """\
name: nightly-demo
input:
  uri: s3://bucket/in/{{ date }}/*.jsonl
  format: jsonl
  prompt_column: prompt
model:
  path: /models/tiny
output:
  uri: s3://bucket/out/{{ date }}/
storage:
  endpoint_url: ${S3_ENDPOINT:-https://storage.eu-north1.nebius.cloud}
"""


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "nightly.yaml"
    path.write_text(JOB_YAML)
    return path


# --- ids and the decision --------------------------------------------------------------------


def test_submission_id_is_deterministic_and_changes_with_date_and_settings(job_file: Path) -> None:
    a = sub.base_submission_id(load_job_spec(job_file, date="2026-11-28"))
    again = sub.base_submission_id(load_job_spec(job_file, date="2026-11-28"))
    other_day = sub.base_submission_id(load_job_spec(job_file, date="2026-11-29"))
    other_settings = sub.base_submission_id(
        load_job_spec(job_file, ["sampling.max_tokens=7"], date="2026-11-28")
    )
    assert a == again
    assert a.startswith("tokenmill-nightly-demo-2026-11-28-")
    assert len(a.rsplit("-", 1)[1]) == 8
    assert len({a, other_day, other_settings}) == 3


def test_attempt_numbers() -> None:
    base = "tokenmill-j-2026-01-01-abcd1234"
    assert sub.attempt_number(base, base) == 1
    assert sub.attempt_number(base, base + "-r2") == 2
    assert sub.attempt_number(base, base + "-r17") == 17
    assert sub.attempt_number(base, base + "-r1") is None  # r1 is spelled as the base id
    assert sub.attempt_number(base, base + "-rx") is None
    assert sub.attempt_number(base, base + "0") is None
    assert sub.attempt_number(base, "tokenmill-j-2026-01-02-abcd1234") is None


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        ({}, ("submit", "B", None)),
        ({"other": "RUNNING"}, ("submit", "B", None)),
        ({"B": "RUNNING"}, ("attach", "B", "RUNNING")),
        ({"B": "PENDING"}, ("attach", "B", "PENDING")),
        ({"B": "SUCCEEDED"}, ("done", "B", "SUCCEEDED")),
        ({"B": "FAILED"}, ("submit", "B-r2", "FAILED")),
        ({"B": "STOPPED"}, ("submit", "B-r2", "STOPPED")),
        ({"B": "FAILED", "B-r2": "FAILED"}, ("submit", "B-r3", "FAILED")),
        ({"B": "FAILED", "B-r2": "RUNNING"}, ("attach", "B-r2", "RUNNING")),
        ({"B": "FAILED", "B-r3": "SUCCEEDED", "B-r2": "FAILED"}, ("done", "B-r3", "SUCCEEDED")),
    ],
)
def test_decide(existing: dict[str, str], expected: tuple[str, str, str | None]) -> None:
    decision = sub.decide("B", existing)
    assert (decision.action, decision.submission_id, decision.previous_status) == expected


def test_exit_codes() -> None:
    assert sub.exit_code_for("SUCCEEDED", 0) == 0
    assert sub.exit_code_for("FAILED", 1) == 1
    assert sub.exit_code_for("FAILED", 3) == 3
    assert sub.exit_code_for("FAILED", 5) == 5
    assert sub.exit_code_for("FAILED", 2) == 1
    assert sub.exit_code_for("STOPPED", None) == 1


# --- environment and auth --------------------------------------------------------------------


def test_forwarded_env_defaults_to_set_aws_vars_and_job_references() -> None:
    environ = {
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "S3_ENDPOINT": "http://minio:9000",
        "HOME": "/root",
    }
    env = sub.forwarded_env(environ, None, JOB_YAML)
    assert env == {
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "S3_ENDPOINT": "http://minio:9000",
    }
    assert sub.forwarded_env(environ, (), "") == {}
    assert sub.forwarded_env(environ, ("HOME",), "") == {"HOME": "/root"}


def test_forwarded_env_names_a_missing_variable() -> None:
    with pytest.raises(sub.SubmitError, match="AWS_SESSION_TOKEN") as info:
        sub.forwarded_env({}, ("AWS_SESSION_TOKEN",))
    assert info.value.exit_code == sub.EXIT_INVALID


def test_auth_token_sources_in_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    assert sub.resolve_auth_token({}, home=home) is None
    (home / ".ray" / "auth_token").write_text("from-home\n")
    assert sub.resolve_auth_token({}, home=home) == "from-home"
    path_file = tmp_path / "tok"
    path_file.write_text("from-path")
    assert sub.resolve_auth_token({"RAY_AUTH_TOKEN_PATH": str(path_file)}, home=home) == (
        "from-path"
    )
    env = {"RAY_AUTH_TOKEN_PATH": str(path_file), "RAY_AUTH_TOKEN": "from-env"}
    assert sub.resolve_auth_token(env, home=home) == "from-env"
    flag_file = tmp_path / "flag"
    flag_file.write_text("from-flag")
    assert sub.resolve_auth_token(env, flag_file, home=home) == "from-flag"
    assert sub.resolve_auth_token({**env, "RAY_AUTH_MODE": "disabled"}, home=home) is None


def test_unreadable_token_file_is_an_actionable_error(tmp_path: Path) -> None:
    with pytest.raises(sub.SubmitError, match="--token-file"):
        sub.resolve_auth_token({}, tmp_path / "missing")


# --- entrypoint and the nightly command ------------------------------------------------------


def test_entrypoint_runs_the_shipped_job_file_with_date_and_overrides() -> None:
    entry = sub.run_entrypoint("nightly.yaml", "2026-11-28", ["a.b=c d"], ship_code=False)
    assert shlex.split(entry) == [
        "tokenmill",
        "run",
        "nightly.yaml",
        "--date",
        "2026-11-28",
        "--set",
        "a.b=c d",
    ]
    shipped = shlex.split(sub.run_entrypoint("j.yaml", "2026-11-28", [], ship_code=True))
    assert shipped[:2] == ["python", "-c"]
    assert shipped[3:] == ["run", "j.yaml", "--date", "2026-11-28"]


def test_runtime_env_ship_code_uploads_both_packages(tmp_path: Path) -> None:
    env = sub.runtime_env_for(tmp_path, {"A": "1"}, ship_code=True)
    assert env["working_dir"] == str(tmp_path)
    assert env["env_vars"] == {"A": "1"}
    assert sorted(Path(p).name for p in env["py_modules"]) == ["engines", "pipeline"]
    assert all((Path(p) / "__init__.py").is_file() for p in env["py_modules"])
    assert "py_modules" not in sub.runtime_env_for(tmp_path, {}, ship_code=False)


def test_nightly_command_template_round_trips() -> None:
    argv = sub.nightly_submit_argv("jobs/nightly.yaml", "http://head:8265", "2026-11-28")
    assert argv == [
        "tokenmill",
        "submit",
        "jobs/nightly.yaml",
        "--address",
        "http://head:8265",
        "--date",
        "2026-11-28",
        "--wait",
    ]
    shell = sub.nightly_submit_shell("jobs/nightly.yaml", "http://head:8265")
    assert shlex.split(shell)[:6] == argv[:6]
    assert shlex.split(shell)[6] == "$(date -u +%F)"


# --- the flow against a fake cluster ---------------------------------------------------------


@dataclass
class FakeJob:
    submission_id: str
    status: str
    driver_exit_code: int | None = None


class FakeClient:
    """In-memory Jobs API: submitted jobs end with `final_status` after being followed."""

    def __init__(self, final_status: str = "SUCCEEDED", driver_exit_code: int = 0) -> None:
        self.jobs: dict[str, FakeJob] = {}
        self.submitted: list[dict[str, Any]] = []
        self.final_status = final_status
        self.driver_exit_code = driver_exit_code

    def list_jobs(self) -> list[FakeJob]:
        return list(self.jobs.values())

    def submit_job(self, **kwargs: Any) -> str:
        sid = kwargs["submission_id"]
        if sid in self.jobs:
            raise RuntimeError(f"Job with submission_id {sid} already exists")
        # The working_dir is a temporary directory: record what it holds while it exists.
        kwargs["working_dir_files"] = sorted(
            p.name for p in Path(kwargs["runtime_env"]["working_dir"]).iterdir()
        )
        self.submitted.append(kwargs)
        self.jobs[sid] = FakeJob(sid, "PENDING")
        return sid

    def get_job_info(self, job_id: str) -> FakeJob:
        return self.jobs[job_id]

    async def tail_job_logs(self, job_id: str):
        yield f"log of {job_id}\n"
        job = self.jobs[job_id]
        job.status, job.driver_exit_code = self.final_status, self.driver_exit_code


def _run(request: sub.SubmitRequest, client: FakeClient, environ: dict[str, str]):
    out = io.StringIO()
    outcome = sub.submit(
        request, environ=environ, client_factory=lambda addr, tok: client, out=out, poll_s=0
    )
    return outcome, out.getvalue()


def test_submit_then_resubmit_attaches_instead_of_running_twice(job_file: Path) -> None:
    client = FakeClient()
    environ = {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "very-secret-value"}
    request = sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28")
    first, log = _run(request, client, environ)
    assert first.action == "submit" and first.exit_code == 0
    (call,) = client.submitted
    assert call["submission_id"] == first.submission_id
    assert shlex.split(call["entrypoint"])[:3] == ["tokenmill", "run", "nightly.yaml"]
    assert call["working_dir_files"] == ["nightly.yaml"]
    assert call["runtime_env"]["env_vars"]["AWS_SECRET_ACCESS_KEY"] == "very-secret-value"
    assert "very-secret-value" not in log and "AWS_SECRET_ACCESS_KEY" in log
    assert call["metadata"]["tokenmill_date"] == "2026-11-28"

    second, log2 = _run(request, client, environ)
    assert second.action == "attach" and second.submission_id == first.submission_id
    assert len(client.submitted) == 1
    assert "not starting a second run" in log2


def test_wait_follows_logs_and_retries_a_failed_night(job_file: Path) -> None:
    client = FakeClient(final_status="FAILED", driver_exit_code=1)
    request = sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28", wait=True)
    failed, log = _run(request, client, {})
    assert failed.status == "FAILED" and failed.exit_code == sub.EXIT_JOB_FAILED
    assert f"log of {failed.submission_id}" in log

    client.final_status, client.driver_exit_code = "SUCCEEDED", 0
    retried, _ = _run(request, client, {})
    assert retried.submission_id == failed.submission_id + "-r2"
    assert retried.previous_status == "FAILED"
    assert retried.status == "SUCCEEDED" and retried.exit_code == 0

    done, log3 = _run(request, client, {})
    assert done.action == "done" and done.submission_id == retried.submission_id
    assert "nothing to do" in log3 and len(client.submitted) == 2


def test_partial_run_exits_3(job_file: Path) -> None:
    client = FakeClient(final_status="FAILED", driver_exit_code=3)
    request = sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28", wait=True)
    outcome, _ = _run(request, client, {})
    assert outcome.exit_code == sub.EXIT_PARTIAL


def test_race_on_the_same_id_attaches(job_file: Path) -> None:
    class RacingClient(FakeClient):
        def submit_job(self, **kwargs: Any) -> str:
            # Someone else submits the same id right before us.
            sid = kwargs["submission_id"]
            self.jobs[sid] = FakeJob(sid, "RUNNING")
            raise RuntimeError("already exists")

    client = RacingClient()
    outcome, log = _run(sub.SubmitRequest(job_file, "http://h:8265", date="2026-11-28"), client, {})
    assert outcome.exit_code == 0 and "someone else" in log


def test_invalid_job_is_rejected_before_contacting_the_cluster(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB_YAML.replace("prompt_column", "promt_column"))

    def no_cluster(address: str, token: str | None) -> Any:
        raise AssertionError("contacted the cluster for an invalid job")

    with pytest.raises(sub.SubmitError) as info:
        sub.submit(sub.SubmitRequest(bad, "http://h:8265"), environ={}, client_factory=no_cluster)
    assert info.value.exit_code == sub.EXIT_INVALID
    assert "promt_column" in str(info.value)


def test_cli_reports_invalid_job_with_exit_2(tmp_path: Path) -> None:
    from pipeline.cli import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    result = CliRunner().invoke(app, ["submit", str(bad), "--address", "http://127.0.0.1:1"])
    assert result.exit_code == 2
    assert "input" in result.output


def _skip_sleeps(monkeypatch: pytest.MonkeyPatch, instead: Any) -> None:
    """The submit's own sleeps (on this thread) go to `instead`. `sub.time` is the time module
    itself: other threads of the test process (Ray Data's, a server's) keep their real sleep,
    or a background loop would spin and land in the record."""
    import threading
    import time

    real, here = time.sleep, threading.current_thread()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is here:
            instead(seconds)
        else:
            real(seconds)

    monkeypatch.setattr(sub.time, "sleep", sleep)


def test_cli_unreachable_cluster_exits_4(job_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli import app

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    sleeps: list[float] = []
    _skip_sleeps(monkeypatch, sleeps.append)
    # Port 9 on loopback: nothing listens there, the connection is refused at once.
    result = CliRunner().invoke(
        app, ["submit", str(job_file), "--address", "http://127.0.0.1:9", "--date", "2026-11-28"]
    )
    assert result.exit_code == sub.EXIT_CLUSTER, result.output
    assert "cannot reach the Ray Jobs API" in result.output
    # Retried with a growing backoff before giving up (a head may be restarting).
    assert sleeps == [sub.CONNECT_BACKOFF_S * 2**i for i in range(sub.CONNECT_ATTEMPTS - 1)]


# --- catching up -----------------------------------------------------------------------------


def test_date_range_inclusive_and_bounded() -> None:
    assert sub.date_range("2026-02-27", "2026-03-01") == ["2026-02-27", "2026-02-28", "2026-03-01"]
    assert sub.date_range("2026-03-01", "2026-03-01") == ["2026-03-01"]
    for since, until in [("2026-03-02", "2026-03-01"), ("2026-3-1", "2026-03-02")]:
        with pytest.raises(sub.SubmitError) as info:
            sub.date_range(since, until)
        assert info.value.exit_code == sub.EXIT_INVALID
    with pytest.raises(sub.SubmitError, match="split the range"):
        sub.date_range("2020-01-01", "2026-01-01")


def test_catch_up_skips_succeeded_nights_and_runs_the_missed_ones(job_file: Path) -> None:
    client = FakeClient()
    request = sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-26", wait=True)
    done_before, _ = _run(request, client, {})  # the 26th already ran
    assert done_before.exit_code == 0

    out = io.StringIO()
    outcomes = sub.submit_range(
        sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28", wait=True),
        "2026-11-25",
        environ={},
        client_factory=lambda addr, tok: client,
        out=out,
        poll_s=0,
    )
    assert [day for day, _ in outcomes] == ["2026-11-25", "2026-11-26", "2026-11-27", "2026-11-28"]
    assert [o.action for _, o in outcomes] == ["submit", "done", "submit", "submit"]
    assert outcomes[1][1].submission_id == done_before.submission_id
    assert len(client.submitted) == 4  # the 26th once, before; three missed nights now
    assert {c["metadata"]["tokenmill_date"] for c in client.submitted[1:]} == {
        "2026-11-25",
        "2026-11-27",
        "2026-11-28",
    }
    assert sub.range_exit_code(outcomes) == 0


def test_catch_up_exit_code_is_the_first_failed_night(job_file: Path) -> None:
    client = FakeClient(final_status="FAILED", driver_exit_code=5)
    outcomes = sub.submit_range(
        sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28", wait=True),
        "2026-11-27",
        environ={},
        client_factory=lambda addr, tok: client,
        out=io.StringIO(),
        poll_s=0,
    )
    assert [o.exit_code for _, o in outcomes] == [5, 5]
    assert sub.range_exit_code(outcomes) == sub.EXIT_BUDGET


def test_ctrl_c_while_following_leaves_the_job_running(job_file: Path) -> None:
    class InterruptedClient(FakeClient):
        async def tail_job_logs(self, job_id: str):
            yield "first line\n"
            raise KeyboardInterrupt

    client = InterruptedClient()
    request = sub.SubmitRequest(job_file, "http://head:8265", date="2026-11-28", wait=True)
    with pytest.raises(sub.SubmitError, match="keeps running") as info:
        _run(request, client, {})
    assert info.value.exit_code == sub.EXIT_INTERRUPTED
    (job,) = client.jobs.values()
    assert job.status == "PENDING"  # nothing stopped it


_STATUSES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")


@given(
    attempts=st.dictionaries(st.integers(1, 12), st.sampled_from(_STATUSES), max_size=6),
    others=st.dictionaries(st.text("abc-r0123456789", max_size=12), st.sampled_from(_STATUSES)),
)
def test_decide_never_reuses_an_id_and_never_runs_beside_an_active_attempt(
    attempts: dict[int, str], others: dict[str, str]
) -> None:
    base = "tokenmill-j-2026-01-01-abcd1234"
    existing = {**others, **{sub.attempt_id(base, n): s for n, s in attempts.items()}}
    decision = sub.decide(base, existing)
    if decision.action == "submit":
        assert decision.submission_id not in existing
        if attempts:  # only after a failed or stopped latest attempt
            assert attempts[max(attempts)] in ("FAILED", "STOPPED")
    else:
        assert existing[decision.submission_id] == decision.previous_status
    assert sub.attempt_number(base, decision.submission_id) is not None


def test_a_submit_whose_answer_was_lost_runs_once(
    job_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster took the job and the answer timed out: the try sent again under the same id
    finds it there, and the night runs once."""
    import requests

    _skip_sleeps(monkeypatch, lambda s: None)

    class LostAnswer(FakeClient):
        def submit_job(self, **kwargs: Any) -> str:
            super().submit_job(**kwargs)
            raise requests.exceptions.ReadTimeout("read timed out")

    client = LostAnswer()
    request = sub.SubmitRequest(job_file, "http://h:8265", date="2026-11-28")
    outcome, log = _run(request, client, {})
    assert outcome.exit_code == 0 and len(client.submitted) == 1
    assert "not starting a second run" in log


def test_a_submit_of_unknown_fate_says_the_job_may_be_running(
    job_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import requests

    _skip_sleeps(monkeypatch, lambda s: None)

    class HeadAway(FakeClient):
        def submit_job(self, **kwargs: Any) -> str:
            raise requests.exceptions.ReadTimeout("read timed out")

        def get_job_info(self, job_id: str) -> FakeJob:
            raise requests.exceptions.ConnectionError("connection reset by peer")

    request = sub.SubmitRequest(job_file, "http://h:8265", date="2026-11-28")
    with pytest.raises(sub.SubmitError) as unknown:
        _run(request, HeadAway(), {})
    assert unknown.value.exit_code == sub.EXIT_CLUSTER
    assert "may be running" in str(unknown.value) and "ray job status" in str(unknown.value)


@pytest.mark.parametrize(
    ("error", "fate"),
    [
        (
            RuntimeError("Request failed with status code 400: Job with id x already exists."),
            "exists",
        ),
        (RuntimeError("Request failed with status code 400: bad runtime_env."), "refused"),
        (RuntimeError("Request failed with status code 500: timed out waiting."), "unknown"),
        (ConnectionRefusedError(111, "Connection refused"), "refused"),
        (TimeoutError("read timed out"), "unknown"),
    ],
)
def test_what_a_failed_submit_may_have_left(error: Exception, fate: str) -> None:
    assert sub.submit_fate(error) == fate


def test_a_connection_never_made_is_a_refusal_through_requests_wrapping() -> None:
    import requests
    from urllib3.exceptions import MaxRetryError, NewConnectionError

    inner = NewConnectionError(None, "Failed to establish a new connection")  # type: ignore[arg-type]
    wrapped = requests.exceptions.ConnectionError(MaxRetryError(None, "/api/jobs/", inner))  # type: ignore[arg-type]
    assert sub.submit_fate(wrapped) == "refused"
    reset = requests.exceptions.ConnectionError(ConnectionResetError(104, "reset by peer"))
    assert sub.submit_fate(reset) == "unknown"
