"""The HAProxy set-up of http.direct_ingress: a wrapper that turns kernel splice off (so client
disconnects reach the replica) and free ports instead of Ray's fixed ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.serve.http import haproxy


def test_wrapper_runs_the_binary_with_splice_off_and_the_callers_arguments(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "fake haproxy"  # a space in the path must survive the quoting
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    fake.chmod(0o755)
    wrapper = haproxy.write_no_splice_wrapper(str(fake), tmp_path)
    out = subprocess.run(
        [str(wrapper), "-db", "-f", "/tmp/a b.cfg"], capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[:4] == ["[-dS]", "[-db]", "[-f]", "[/tmp/a b.cfg]"]


def test_the_wrapped_bundled_haproxy_runs(tmp_path: Path) -> None:
    binary = haproxy.haproxy_binary()
    wrapper = haproxy.write_no_splice_wrapper(binary, tmp_path)
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "defaults\n    mode http\nfrontend f\n    bind 127.0.0.1:18080\n    default_backend b\n"
        "backend b\n    server s 127.0.0.1:1\n"
    )
    # -c: check the configuration and exit; through the wrapper, with -dS in front.
    out = subprocess.run([str(wrapper), "-c", "-f", str(config)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_env_keeps_what_the_user_set_and_picks_distinct_free_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")
    for name in ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(haproxy.BINARY_ENV, raising=False)
    env, directory = haproxy.direct_ingress_env()
    try:
        assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in env
        assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        ports = {env["RAY_SERVE_HAPROXY_METRICS_PORT"], env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]}
        assert len(ports) == 2 and all(1024 < int(p) < 65536 for p in ports)
        wrapper = Path(env[haproxy.BINARY_ENV])
        assert wrapper.parent == directory
        assert haproxy.haproxy_binary() in wrapper.read_text()
    finally:
        shutil.rmtree(directory)


def test_a_user_binary_is_wrapped_not_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    own = tmp_path / "haproxy-2.9"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    monkeypatch.setenv(haproxy.BINARY_ENV, str(own))
    env, directory = haproxy.direct_ingress_env()
    try:
        assert f'"{own}" -dS' in Path(env[haproxy.BINARY_ENV]).read_text()
    finally:
        shutil.rmtree(directory)
