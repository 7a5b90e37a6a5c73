"""Submit a job file to a remote Ray cluster through the Ray Jobs API, at most once per night.

`tokenmill submit JOB.yaml --address http://HEAD:8265 --date D` does what `ray job submit`
does, plus three things the nightly schedule needs:

1. The job is validated here first (`load_job_spec` with the date), so a typo fails on the
   submitting machine with the field path, not minutes later inside the cluster.
2. The submission id is deterministic: `tokenmill-<name>-<date>-<hash8>`, the hash covering the
   rendered spec. Submitting the same night twice finds the first submission and attaches to it
   (or reports it) instead of starting a second run. A FAILED or STOPPED attempt is retried as
   `<id>-r2`, `<id>-r3`, ...; the rerun resumes from the parts the failed attempt committed.
3. Storage credentials travel by name from the submitter's environment into the job's
   runtime_env `env_vars`: they are never written into the job file and never logged.

The decision (submit, attach or report) is a pure function of the ids already on the cluster
(`decide`), so it is tested without a cluster; the Ray client sits behind `JobsClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import engines
import pipeline
from pipeline.spec import JobSpec, SpecError, env_references, load_job_spec, today_utc

# --- exit codes ------------------------------------------------------------------------------

EXIT_OK = 0  # submitted (no --wait), or the job succeeded
EXIT_JOB_FAILED = 1  # the job ended FAILED or STOPPED
EXIT_INVALID = 2  # the job file or the arguments are wrong; nothing was submitted
EXIT_PARTIAL = 3  # `tokenmill run` exited 3: too many error rows (resubmit to retry them)
EXIT_CLUSTER = 4  # the cluster could not be reached, refused the token, or refused the job
EXIT_BUDGET = 5  # `tokenmill run` exited 5: stopped at cost.budget_usd (raise it to resume)
EXIT_INTERRUPTED = 130  # Ctrl-C while following; the job itself keeps running
# `tokenmill run` exit codes passed through as ours: they tell the operator what to do next.
_PASSED_THROUGH = frozenset({EXIT_PARTIAL, EXIT_BUDGET})

# Statuses as the Jobs API spells them (ray.job_submission.JobStatus values).
RETRYABLE_STATUSES = frozenset({"FAILED", "STOPPED"})
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})

# Forwarded when they are set and no --env-from is given: what s3fs/pyarrow/boto read.
DEFAULT_ENV_FROM = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)

# The nightly schedule's command, in one place: the Kubernetes CronJob in
# infra/terraform/workloads/nightly.tf runs exactly this (with `{date}` = "$(date -u +%F)"),
# and tests/e2e/test_submit.py runs it with a concrete date. tests/unit/test_terraform*.py
# checks that the two agree.
NIGHTLY_SUBMIT_TEMPLATE = "tokenmill submit {job_file} --address {address} --date {date} --wait"
# Shell expression the CronJob uses for "today" (UTC) in place of a concrete date.
NIGHTLY_DATE_EXPR = '"$(date -u +%F)"'

_SUBMISSION_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_RETRY_SUFFIX = re.compile(r"^-r(\d+)$")


class SubmitError(RuntimeError):
    """Submission could not proceed; `exit_code` says why (see the EXIT_* constants)."""

    def __init__(self, message: str, exit_code: int = EXIT_CLUSTER) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- the nightly command ---------------------------------------------------------------------


def nightly_submit_argv(job_file: str, address: str, date: str) -> list[str]:
    """The nightly schedule's command as argv, rendered from NIGHTLY_SUBMIT_TEMPLATE."""
    rendered = NIGHTLY_SUBMIT_TEMPLATE.format(
        job_file=shlex.quote(job_file), address=shlex.quote(address), date=shlex.quote(date)
    )
    return shlex.split(rendered)


def nightly_submit_shell(job_file: str, address: str) -> str:
    """The same command as one shell line with the date computed at run time (the CronJob)."""
    return NIGHTLY_SUBMIT_TEMPLATE.format(
        job_file=job_file, address=address, date=NIGHTLY_DATE_EXPR
    )


# --- submission ids --------------------------------------------------------------------------


def spec_digest(spec: JobSpec) -> str:
    """Short hash of the rendered, validated spec (date and --set overrides included).

    Two submissions of the same night with the same settings share it; changing anything that
    changes the run (model, sampling, paths) gives a new id, so it cannot attach to an old run.
    """
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def base_submission_id(spec: JobSpec) -> str:
    """`tokenmill-<name>-<date>-<hash8>`; characters the Jobs API dislikes become '-'."""
    name = _SUBMISSION_ID_CHARS.sub("-", spec.name)
    return f"tokenmill-{name}-{spec.date}-{spec_digest(spec)}"


def attempt_number(base_id: str, submission_id: str) -> int | None:
    """1 for the base id, N for `<base>-rN`, None for an id of some other job."""
    if submission_id == base_id:
        return 1
    if not submission_id.startswith(base_id):
        return None
    match = _RETRY_SUFFIX.match(submission_id[len(base_id) :])
    return int(match.group(1)) if match and int(match.group(1)) >= 2 else None


def attempt_id(base_id: str, attempt: int) -> str:
    return base_id if attempt == 1 else f"{base_id}-r{attempt}"


@dataclass(frozen=True)
class Decision:
    """What to do given the attempts already on the cluster."""

    action: Literal["submit", "attach", "done"]
    submission_id: str  # the id to submit, or the existing attempt to attach to / report
    previous_status: str | None  # status of the latest existing attempt; None if there is none


def decide(base_id: str, existing: Mapping[str, str]) -> Decision:
    """Pick the action from `existing` (submission id -> status of every job on the cluster).

    Only the latest attempt of this base id matters: running → attach (never a second run),
    succeeded → nothing to do, failed/stopped → submit the next attempt, which resumes.
    """
    attempts = {
        number: status
        for sid, status in existing.items()
        if (number := attempt_number(base_id, sid)) is not None
    }
    if not attempts:
        return Decision("submit", base_id, None)
    latest = max(attempts)
    status = attempts[latest]
    if status in RETRYABLE_STATUSES:
        return Decision("submit", attempt_id(base_id, latest + 1), status)
    if status == "SUCCEEDED":
        return Decision("done", attempt_id(base_id, latest), status)
    return Decision("attach", attempt_id(base_id, latest), status)


def exit_code_for(status: str, driver_exit_code: int | None) -> int:
    """Map a terminal job status to this command's exit code (`tokenmill run` 3 and 5 stay)."""
    if status == "SUCCEEDED":
        return EXIT_OK
    if driver_exit_code in _PASSED_THROUGH:
        return driver_exit_code
    return EXIT_JOB_FAILED


# --- environment, auth, runtime env ----------------------------------------------------------


def forwarded_env(
    environ: Mapping[str, str],
    env_from: Sequence[str] | None,
    job_text: str = "",
) -> dict[str, str]:
    """Environment values the job gets through runtime_env env_vars.

    `env_from` None: the standard AWS variables that are set. A list: exactly those names, each
    of which must be set. Either way, `${VAR}`s the job file uses are added when set here.
    """
    names: list[str]
    if env_from is None:
        names = [name for name in DEFAULT_ENV_FROM if name in environ]
    else:
        missing = [name for name in env_from if name not in environ]
        if missing:
            raise SubmitError(
                f"--env-from names variable(s) that are not set here: {', '.join(missing)} "
                "(export them, or drop them from --env-from)",
                EXIT_INVALID,
            )
        names = list(env_from)
    # The job renders its `${VAR}`s again inside the cluster.
    names += [name for name in env_references(job_text) if name in environ]
    return {name: environ[name] for name in dict.fromkeys(names)}


def resolve_auth_token(
    environ: Mapping[str, str], token_file: Path | None = None, home: Path | None = None
) -> str | None:
    """The Ray auth token to send, or None when the cluster runs without token auth.

    Order: --token-file, $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token (the file
    `ray start` and `ray get-auth-token --generate` write). RAY_AUTH_MODE=disabled sends none.
    """
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    if token_file is not None:
        return _read_token(token_file, "--token-file")
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return environ["RAY_AUTH_TOKEN"].strip()
    if environ.get("RAY_AUTH_TOKEN_PATH"):
        return _read_token(Path(environ["RAY_AUTH_TOKEN_PATH"]), "$RAY_AUTH_TOKEN_PATH")
    default = (home or Path.home()) / ".ray" / "auth_token"
    return _read_token(default, str(default)) if default.is_file() else None


def _read_token(path: Path, source: str) -> str:
    try:
        token = path.expanduser().read_text().strip()
    except OSError as exc:
        raise SubmitError(
            f"cannot read the Ray auth token from {path} ({source}): {exc.strerror or exc}",
            EXIT_INVALID,
        ) from None
    if not token:
        raise SubmitError(f"the Ray auth token file {path} ({source}) is empty", EXIT_INVALID)
    return token


def run_entrypoint(job_file_name: str, date: str, overrides: Sequence[str], ship_code: bool) -> str:
    """The command the cluster runs: `tokenmill run <job file> --date D [--set k=v ...]`.

    With shipped code there may be no `tokenmill` script on the cluster, so the same CLI is
    started from the uploaded `pipeline` package instead.
    """
    program = (
        ["python", "-c", "from pipeline.cli import app; app(prog_name='tokenmill')"]
        if ship_code
        else ["tokenmill"]
    )
    args = ["run", job_file_name, "--date", date]
    for item in overrides:
        args += ["--set", item]
    return shlex.join(program + args)


def code_packages() -> list[Path]:
    """Directories of the `pipeline` and `engines` packages, uploaded by --ship-code."""

    return [Path(pipeline.__file__).parent, Path(engines.__file__).parent]


def runtime_env_for(
    working_dir: Path, env_vars: Mapping[str, str], ship_code: bool
) -> dict[str, Any]:
    """runtime_env: a working_dir holding just the job file, env vars, code when shipped."""
    runtime_env: dict[str, Any] = {"working_dir": str(working_dir)}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    if ship_code:
        runtime_env["py_modules"] = [str(path) for path in code_packages()]
        runtime_env["excludes"] = ["__pycache__", "*.pyc"]
    return runtime_env


# --- the Jobs API, behind a small protocol ---------------------------------------------------


class JobsClient(Protocol):
    """The subset of ray.job_submission.JobSubmissionClient used here (tests fake it)."""

    def list_jobs(self) -> list[Any]: ...

    def submit_job(self, **kwargs: Any) -> str: ...

    def get_job_info(self, job_id: str) -> Any: ...

    def tail_job_logs(self, job_id: str) -> Any: ...


@contextlib.contextmanager
def _explicit_address() -> Iterator[None]:
    """Hide RAY_ADDRESS / RAY_API_SERVER_ADDRESS while the client is built.

    JobSubmissionClient prefers those variables over its `address` argument; under
    `ray job submit` or in a pod they may point elsewhere, and --address must win.
    """
    saved = {
        k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


# A head that is starting or restarting answers with connection errors for a few seconds;
# a nightly submission should ride that out instead of failing the night.
CONNECT_ATTEMPTS = 4
CONNECT_BACKOFF_S = 2.0


def _is_auth_failure(exc: Exception) -> bool:
    text = str(exc).lower()
    return "auth" in text or "401" in text or "403" in text


def connect(
    address: str,
    token: str | None,
    attempts: int = CONNECT_ATTEMPTS,
    backoff_s: float = CONNECT_BACKOFF_S,
) -> JobsClient:
    """A JobSubmissionClient for `address`, sending the token as a bearer header if given.

    Connection failures are retried (`attempts` tries, backoff doubling); an auth refusal is
    final at once, since retrying cannot fix a wrong token.
    """
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else None
    for attempt in range(1, attempts + 1):
        try:
            with _explicit_address():
                return JobSubmissionClient(address, headers=headers)
        except Exception as exc:
            if not _is_auth_failure(exc) and attempt < attempts:
                time.sleep(backoff_s * 2 ** (attempt - 1))
                continue
            hint = (
                " The cluster uses token auth: pass --token-file, or set RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH (see docs/operations.md)."
                if _is_auth_failure(exc)
                else " Check that the head's dashboard port (8265) is reachable from here."
            )
            raise SubmitError(f"cannot reach the Ray Jobs API at {address}: {exc}.{hint}") from None
    raise AssertionError("unreachable")  # the loop returns or raises


# --- what a submit that raised left on the cluster -----------------------------------------

# Ray keeps one job per submission id, so a submit whose answer was lost can be sent again with
# the same id: either it lands now or Ray answers that the id exists (the first one landed).
SUBMIT_ATTEMPTS = 3
SUBMIT_BACKOFF_S = 0.5

SubmitFate = Literal["accepted", "exists", "refused", "unknown"]
# Exceptions (by class name, anywhere in the chain) of a connection that was never made: the
# request was not sent. requests and urllib3 wrap them, so names are matched, not classes.
_NEVER_CONNECTED = frozenset(
    {"ConnectionRefusedError", "NewConnectionError", "ConnectTimeout", "NameResolutionError"}
)


def submit_fate(exc: BaseException) -> SubmitFate:
    """What a `submit_job` that raised `exc` may have left on the cluster.

    "exists": Ray answered that the submission id exists (another submitter's, or an earlier
    try of ours whose answer was lost).
    "refused": Ray answered 4xx (the same body is refused every time), or no connection was
    made. "unknown": anything else; a read timeout or a reset connection may come after Ray
    took the job, and a 500 is what the head answers when it times out waiting for the agent
    that goes on to start the job.
    """
    text = str(exc)
    if "already exists" in text:
        return "exists"
    answered = re.search(r"status code (\d{3})", text)
    if answered is not None and 400 <= int(answered.group(1)) < 500:
        return "refused"
    if _never_connected(exc):
        return "refused"
    return "unknown"


def _never_connected(exc: BaseException) -> bool:
    seen: set[int] = set()
    pending: list[Any] = [exc]
    while pending:
        item = pending.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if type(item).__name__ in _NEVER_CONNECTED:
            return True
        pending += [item.__cause__, item.__context__, getattr(item, "reason", None), *item.args]
    return False


def job_exists(client: Any, submission_id: str) -> bool | None:
    """Whether the cluster has the job: True, False (Ray answered that it does not exist), or
    None (no answer: the head is away)."""
    try:
        client.get_job_info(submission_id)
    except Exception as exc:
        return False if job_missing(exc) else None
    return True


def job_missing(exc: BaseException) -> bool:
    """Whether a Jobs API call failed because Ray answered that the job does not exist."""
    text = str(exc)
    return "status code 404" in text or "does not exist" in text


def submit_once(
    client: Any,
    attempts: int = SUBMIT_ATTEMPTS,
    backoff_s: float = SUBMIT_BACKOFF_S,
    **kwargs: Any,
) -> tuple[SubmitFate, BaseException | None]:
    """`client.submit_job(**kwargs)` (a fixed `submission_id` among them) until its fate is
    known, `attempts` times at most; then what happened (submit_fate; "accepted": this call
    was answered) and the last error. A submit whose fate stays unknown is looked up before
    the answer is given: "unknown" means the job may still appear (the caller keeps whatever
    lets an operator find and stop it)."""
    fate: SubmitFate = "refused"
    error: BaseException | None = None
    for attempt in range(attempts):
        try:
            client.submit_job(**kwargs)
            return "accepted", None
        except Exception as exc:
            error = exc
            this = submit_fate(exc)
        if this == "exists":
            return "exists", None
        answered_no = this == "refused" and "status code" in str(error)
        if answered_no:
            return "refused", error  # Ray refused this body: it refused the earlier tries too
        if this == "unknown":
            fate = "unknown"
        if attempt + 1 < attempts:
            time.sleep(backoff_s * 2**attempt)
    if fate == "unknown" and job_exists(client, kwargs["submission_id"]):
        return "exists", None
    return fate, error


def existing_jobs(client: JobsClient) -> dict[str, str]:
    """submission id -> status for every job the cluster knows."""
    return {
        job.submission_id: str(getattr(job.status, "value", job.status))
        for job in client.list_jobs()
        if job.submission_id
    }


# --- one submission --------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitRequest:
    """Everything `tokenmill submit` was asked to do."""

    job_file: Path  # the job YAML on this machine
    address: str  # Ray dashboard / Jobs API URL, e.g. http://head:8265
    date: str | None = None  # run date; None: the file's `date:` or today UTC
    overrides: tuple[str, ...] = ()  # `--set a.b=c`, applied here and again in the cluster
    wait: bool = False  # follow logs until the job ends and exit with its status
    ship_code: bool = False  # upload `pipeline` and `engines` as py_modules
    env_from: tuple[str, ...] | None = None  # variable names to forward; None: AWS defaults
    token_file: Path | None = None  # Ray auth token file; None: env vars, ~/.ray/auth_token


@dataclass
class SubmitOutcome:
    """What happened, for the CLI to print and exit with."""

    submission_id: str
    action: Literal["submit", "attach", "done"]
    previous_status: str | None
    status: str | None = None  # final status when waited (or already terminal)
    exit_code: int = EXIT_OK
    forwarded_env_names: list[str] = field(default_factory=list)


def prepare(request: SubmitRequest, environ: Mapping[str, str]) -> tuple[JobSpec, str]:
    """Validate the job locally; returns the spec and the raw job text (shipped as is)."""

    try:
        spec = load_job_spec(
            request.job_file, list(request.overrides), date=request.date, env=dict(environ)
        )
    except SpecError as exc:
        raise SubmitError(str(exc), EXIT_INVALID) from None
    return spec, request.job_file.read_text()


def submit(
    request: SubmitRequest,
    *,
    environ: Mapping[str, str] | None = None,
    client_factory: Callable[[str, str | None], JobsClient] = connect,
    out: TextIO | None = None,
    poll_s: float = 1.0,
) -> SubmitOutcome:
    """Validate, then submit / attach / report, then (with `wait`) follow to the end."""
    environ = dict(os.environ) if environ is None else environ
    out = out or sys.stdout
    spec, job_text = prepare(request, environ)
    env_vars = forwarded_env(environ, request.env_from, job_text)
    token = resolve_auth_token(environ, request.token_file)
    client = client_factory(request.address, token)

    base_id = base_submission_id(spec)
    decision = decide(base_id, existing_jobs(client))
    outcome = SubmitOutcome(
        decision.submission_id,
        decision.action,
        decision.previous_status,
        forwarded_env_names=sorted(env_vars),
    )
    if decision.action == "submit":
        _submit_attempt(client, request, spec, decision, env_vars, out)
    elif decision.action == "attach":
        print(
            f"{decision.submission_id} is already {decision.previous_status}; not starting a "
            "second run" + (", following it" if request.wait else ""),
            file=out,
        )
    if decision.action == "done":
        outcome.status = "SUCCEEDED"
        print(
            f"{decision.submission_id} already SUCCEEDED for {spec.date}; nothing to do "
            "(change the job or --date to run something else)",
            file=out,
        )
        return outcome
    if request.wait:
        outcome.status, outcome.exit_code = follow(client, outcome.submission_id, out, poll_s)
        print(f"{outcome.submission_id} {outcome.status}", file=out)
    return outcome


def _submit_attempt(
    client: JobsClient,
    request: SubmitRequest,
    spec: JobSpec,
    decision: Decision,
    env_vars: Mapping[str, str],
    out: TextIO,
) -> None:
    date = spec.date or ""  # load_job_spec always sets it
    with tempfile.TemporaryDirectory(prefix="tokenmill-submit-") as tmp:
        # working_dir carries only the job file: the code is the image's (or --ship-code's).
        working_dir = Path(tmp)
        shutil.copyfile(request.job_file, working_dir / request.job_file.name)
        entrypoint = run_entrypoint(
            request.job_file.name, date, request.overrides, request.ship_code
        )
        # An id that exists already (another submitter took it between our listing and our
        # submit, or our own first try landed before its answer was lost) is attached to:
        # never two runs of one night.
        fate, error = submit_once(
            client,
            entrypoint=entrypoint,
            submission_id=decision.submission_id,
            runtime_env=runtime_env_for(working_dir, env_vars, request.ship_code),
            metadata={
                "tokenmill_job": spec.name,
                "tokenmill_date": date,
                "tokenmill_spec_sha": spec_digest(spec),
            },
        )
        if fate == "exists":
            print(
                f"{decision.submission_id} exists already (submitted by someone else, or by "
                "an earlier try whose answer was lost); not starting a second run",
                file=out,
            )
            return
        if fate == "refused":
            raise SubmitError(f"the cluster refused {decision.submission_id}: {error}")
        if fate == "unknown":
            raise SubmitError(
                f"the cluster did not say whether it took {decision.submission_id} ({error}); "
                f"it may be running: `ray job status {decision.submission_id}` tells, and "
                "submitting again attaches to it if it exists"
            )
    retry = f" (retry after {decision.previous_status})" if decision.previous_status else ""
    print(f"submitted {decision.submission_id}{retry}: {entrypoint}", file=out)
    if env_vars:
        # Names only: values are credentials.
        print(f"forwarded environment: {', '.join(sorted(env_vars))}", file=out)


def follow(
    client: JobsClient, submission_id: str, out: TextIO, poll_s: float = 1.0
) -> tuple[str, int]:
    """Stream the job's logs to `out` until it ends; returns (status, exit code).

    Ctrl-C stops following, not the job: it keeps running on the cluster.
    """
    try:
        asyncio.run(_tail(client, submission_id, out))
    except KeyboardInterrupt:
        raise SubmitError(
            f"stopped following {submission_id}; the job keeps running "
            f"(`ray job stop {submission_id}` stops it; submitting again attaches to it)",
            EXIT_INTERRUPTED,
        ) from None
    except Exception as exc:
        # The log stream is a convenience; the status below is what decides the exit code.
        print(f"(log stream ended early: {exc}; waiting for the job status)", file=out)
    while True:
        info = client.get_job_info(submission_id)
        status = str(getattr(info.status, "value", info.status))
        if status in TERMINAL_STATUSES:
            return status, exit_code_for(status, getattr(info, "driver_exit_code", None))
        time.sleep(poll_s)


async def _tail(client: JobsClient, submission_id: str, out: TextIO) -> None:
    async for chunk in client.tail_job_logs(submission_id):
        out.write(chunk)
        out.flush()


# --- catching up a range of nights -----------------------------------------------------------

MAX_CATCH_UP_DAYS = 366


def date_range(since: str, until: str) -> list[str]:
    """Every date from `since` to `until`, both included, oldest first."""
    import datetime as dt

    try:
        first, last = dt.date.fromisoformat(since), dt.date.fromisoformat(until)
    except ValueError:
        raise SubmitError(
            f"--since {since!r} / --date {until!r}: dates are YYYY-MM-DD", EXIT_INVALID
        ) from None
    if first > last:
        raise SubmitError(f"--since {since} is after {until}; nothing to catch up", EXIT_INVALID)
    days = (last - first).days + 1
    if days > MAX_CATCH_UP_DAYS:
        raise SubmitError(
            f"--since {since} spans {days} nights (at most {MAX_CATCH_UP_DAYS}); split the range",
            EXIT_INVALID,
        )
    return [(first + dt.timedelta(days=i)).isoformat() for i in range(days)]


def submit_range(
    request: SubmitRequest,
    since: str,
    *,
    environ: Mapping[str, str] | None = None,
    client_factory: Callable[[str, str | None], JobsClient] = connect,
    out: TextIO | None = None,
    poll_s: float = 1.0,
) -> list[tuple[str, SubmitOutcome]]:
    """Catch up every night from `since` to the request's date (default today UTC).

    Each night goes through `submit`, so nights that succeeded are only reported, running ones
    attached to, failed ones resumed. With `wait` they run one after the other; a failed night
    does not stop the next ones (nights are independent).
    """

    out = out or sys.stdout
    outcomes = []
    for day in date_range(since, request.date or today_utc()):
        print(f"--- {day}", file=out)
        night = dataclasses.replace(request, date=day)
        outcome = submit(
            night, environ=environ, client_factory=client_factory, out=out, poll_s=poll_s
        )
        outcomes.append((day, outcome))
    return outcomes


def range_exit_code(outcomes: Sequence[tuple[str, SubmitOutcome]]) -> int:
    """The first non-zero night's exit code (in date order), or 0."""
    return next((o.exit_code for _, o in outcomes if o.exit_code != EXIT_OK), EXIT_OK)
