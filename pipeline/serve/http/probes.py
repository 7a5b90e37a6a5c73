"""/ready and /health, each answered by a small Serve application of its own.

Not by the ingress: with http.one_hop the engine lives in the ingress replica, and while the
only replica of such an app is being replaced there is no ingress at all, so a probe sent to
it waits for the new one (a Kubernetes probe times out after 1 s by default, and would mark
the pod unready or restart it just as it recovers). Serve routes by path prefix, HAProxy and
the Python proxy alike, longest prefix first: `/ready` and `/health` reach these two
applications, everything else the main one at `/`. Each runs one replica that holds no engine,
reserves no CPU and answers from memory, within milliseconds, whatever the controller and the
engine replicas are doing:

- /health (liveness): 200 `{"status": "ok"}` while the HTTP path and this replica answer. It
  says nothing about engines: a broken engine gets its replica replaced by Serve, never the
  pod restarted.
- /ready (readiness): the readiness view (pipeline/serve/replicas/readiness.py), refreshed by a
  background thread that reads the app's board every REFRESH_S: the replicas' reports and
  Serve's running replicas, which the board keeps (so neither a slow controller nor parsing
  its status ever holds up this process). 200 when every model has a replica that can serve,
  else 503; the body has counts and the view's age, never model names (the probes need no
  key; the names of the models not serving go to this replica's log).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from pipeline.openai.errors import ApiError
from pipeline.serve.replicas.board import STALE_AFTER_S, Snapshot, open_board
from pipeline.serve.replicas.readiness import ReadinessView
from pipeline.serve.spec import ServeSpec, engine_deployments, load_serve_spec

logger = logging.getLogger(__name__)

READY_ROUTE = "/ready"
HEALTH_ROUTE = "/health"
# Replicas push a failure to the board at once; this is how soon /ready sees it.
REFRESH_S = 0.2
BOARD_READ_TIMEOUT_S = 2.0
# Probes are cheap: let many in at once rather than queue them behind Serve's default cap.
PROBE_OPTIONS: dict[str, Any] = {
    "num_replicas": 1,
    "ray_actor_options": {"num_cpus": 0},
    "max_ongoing_requests": 256,
}


def probe_app_name(app_name: str, route: str) -> str:
    """The Serve application answering `route` for the application `app_name`."""
    return f"{app_name}-{route.strip('/')}"


@serve.deployment(**PROBE_OPTIONS)
class ReadyProbe:
    """/ready: is every model of `app_name` served by a replica that can take a request?"""

    def __init__(self, app_name: str, deployments: Mapping[str, str]) -> None:
        self._app_name = app_name
        self._view = ReadinessView(deployments, STALE_AFTER_S)
        self._board: Any = None
        self._logged: tuple[str, ...] | None = None  # the unserved models last logged
        self._stop = threading.Event()
        _every(REFRESH_S, self._stop, self._refresh, "the app's board")

    async def __call__(self, request: Request) -> JSONResponse:
        if not _is_the_probe(request):
            return _not_found(request)
        readiness = self._view.current(time.monotonic())
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    def _refresh(self) -> None:
        if self._board is None:
            self._board = open_board(self._app_name)
        try:
            snapshot: Snapshot = ray.get(
                self._board.snapshot.remote(), timeout=BOARD_READ_TIMEOUT_S
            )
        except Exception:
            self._board = None  # killed (its app was redeployed): open it again next time
            raise
        now = time.monotonic()
        if snapshot.running is not None:
            self._view.set_running(snapshot.running, at=now - snapshot.running_age_s)
        self._view.set_reports(snapshot.reports, at=now)
        self._log_change(now)

    def _log_change(self, now: float) -> None:
        """Log which models stopped or started serving (by name: the log is the operator's)."""
        readiness = self._view.current(now)
        if readiness.age_s is None or readiness.unserved == self._logged:
            return
        self._logged = readiness.unserved
        if readiness.unserved:
            logger.warning(
                "app %s: no replica can serve %s", self._app_name, ", ".join(readiness.unserved)
            )
        else:
            logger.info("app %s: every model has a replica that can serve", self._app_name)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


@serve.deployment(**PROBE_OPTIONS)
class LiveProbe:
    """/health: this replica, and the HTTP path to it, answer."""

    async def __call__(self, request: Request) -> JSONResponse:
        if not _is_the_probe(request):
            return _not_found(request)
        return JSONResponse({"status": "ok"})


def _is_the_probe(request: Request) -> bool:
    """The route itself (Serve sets root_path to the app's route prefix), not a path below it."""
    return request.scope["path"][len(request.scope.get("root_path", "")) :] in ("", "/")


def _not_found(request: Request) -> JSONResponse:
    error = ApiError(404, f"{request.method} {request.url.path}: Not Found", code="not_found")
    return JSONResponse(error.body(), status_code=404)


def _every(
    period_s: float, stop: threading.Event, read: Callable[[], None], what: str
) -> threading.Thread:
    """Call `read` now and every `period_s` on a daemon thread until `stop` is set; a failed
    read is logged once (until one succeeds again) and leaves the view as it was."""

    def loop() -> None:
        failing = False
        while True:
            try:
                read()
            except Exception:
                if not failing:
                    logger.warning(
                        "reading %s failed; /ready answers from the last read", what, exc_info=True
                    )
                failing = True
            else:
                if failing:
                    logger.info("reading %s works again", what)
                failing = False
            if stop.wait(period_s):
                return

    thread = threading.Thread(target=loop, name=f"ready-probe: {what}", daemon=True)
    thread.start()
    return thread


# --- assembly --------------------------------------------------------------------------------


def probe_targets(spec: ServeSpec, app_name: str, **run_options: Any) -> list[serve.RunTarget]:
    """The two probe applications of the application `app_name`, for `serve.run_many`."""
    return [
        serve.RunTarget(
            ReadyProbe.bind(app_name, engine_deployments(spec)),
            name=probe_app_name(app_name, READY_ROUTE),
            route_prefix=READY_ROUTE,
            **run_options,
        ),
        serve.RunTarget(
            LiveProbe.bind(),
            name=probe_app_name(app_name, HEALTH_ROUTE),
            route_prefix=HEALTH_ROUTE,
            **run_options,
        ),
    ]


def ready_app_builder(args: dict[str, str]) -> serve.Application:
    """Entry for KubeRay's serveConfigV2 (import_path + args): `config` is the serve file,
    `app` the name the main application runs under there (default: the file's `name`)."""
    return ReadyProbe.bind(*ready_probe_args(args))


def ready_probe_args(args: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The watched app's name and its models' engine deployments, from the builder's args."""

    spec = load_serve_spec(args["config"])
    return args.get("app", spec.name), engine_deployments(spec)


def health_app_builder(args: dict[str, str]) -> serve.Application:
    """Entry for KubeRay's serveConfigV2; takes no args."""
    return LiveProbe.bind()
