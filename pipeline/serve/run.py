"""Run the Serve application on Ray until told to stop: what `tokenmill serve` does.

Starts (or joins, with RAY_ADDRESS) a Ray cluster, starts Serve's HTTP proxy on the given
host and port, deploys the app with its two probe apps (/ready, /health:
pipeline/serve/http/probes.py), and blocks until Ctrl-C or SIGTERM, then deletes the apps, the
limits coordinator and the board (or stops Serve, when the cluster is this process's own) so
replicas release their engines before the process exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.serve.access.auth import KeyDigests
from pipeline.serve.http.haproxy import direct_ingress_env
from pipeline.serve.spec import ServeSpec


@dataclass(frozen=True)
class ServerOptions:
    host: str  # HTTP listen address
    port: int  # HTTP listen port
    num_cpus: int | None = None  # CPUs of a local Ray started here; None: all of them
    object_store_mb: int | None = None  # object store of a local Ray; None: Ray's default


def start_ray(options: ServerOptions) -> bool:
    """Join RAY_ADDRESS if set, else start a private local Ray (never someone else's).
    True when the Ray (and so the Serve instance) is this process's own."""
    import ray

    address = os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, object] = {"address": address}
    if address == "local":
        kwargs["include_dashboard"] = False  # Serve does not need it; it costs memory
        if options.num_cpus is not None:
            kwargs["num_cpus"] = options.num_cpus
        if options.object_store_mb is not None:
            kwargs["object_store_memory"] = options.object_store_mb * 1024**2
    ray.init(**kwargs, log_to_driver=True)
    return address == "local"


def run_server(
    spec: ServeSpec,
    keys: KeyDigests,
    options: ServerOptions,
    on_ready: Callable[[str], None] = print,
) -> None:
    """Deploy and block until SIGINT/SIGTERM; `on_ready` gets the base URL once it serves."""
    wrapper_dir = None
    if spec.http.direct_ingress and not os.environ.get("RAY_ADDRESS"):
        # Read when Ray's Serve modules load, here and in every process of the Ray started
        # below (which inherit this environment): so set before either happens.
        env, wrapper_dir = direct_ingress_env()
        os.environ.update(env)
    try:
        _serve_until_stopped(spec, keys, options, on_ready)
    finally:
        if wrapper_dir is not None:
            shutil.rmtree(wrapper_dir, ignore_errors=True)


def _serve_until_stopped(
    spec: ServeSpec,
    keys: KeyDigests,
    options: ServerOptions,
    on_ready: Callable[[str], None],
) -> None:
    import ray
    from ray import serve

    # lazy: `tokenmill serve --help` and the file checks run without Ray Serve
    from pipeline.serve.access.limit_coordinator import kill_coordinator
    from pipeline.serve.app import build_app
    from pipeline.serve.http.probes import probe_targets
    from pipeline.serve.replicas.board import kill_board

    stop = threading.Event()
    logging_config = {"enable_access_log": spec.http.access_log}
    probes = probe_targets(spec, spec.name, logging_config=logging_config)
    own_cluster = start_ray(options)
    # After ray.init, which installs a SIGTERM handler of its own that would kill the driver
    # without letting Serve stop its replicas.
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        serve.start(
            http_options={"host": options.host, "port": options.port}, proxy_location="HeadOnly"
        )
        main = serve.RunTarget(
            build_app(spec, keys), name=spec.name, route_prefix="/", logging_config=logging_config
        )
        # Together: the probes answer (503 at first) while the engines load.
        serve.run_many([*probes, main])
        on_ready(f"http://{options.host}:{options.port}/v1")
        while not stop.wait(timeout=1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            # On a shared cluster only this app and its probes go (with its limits coordinator
            # and board, detached so that they outlive replicas); other Serve apps keep running.
            if own_cluster:
                serve.shutdown()
            else:
                for name in [spec.name, *(target.name for target in probes)]:
                    serve.delete(name)
                kill_coordinator(spec.name)
                kill_board(spec.name)
        finally:
            ray.shutdown()
