"""`tokenmill doctor` on RAY_ADDRESS=auto: the Ray last started here must answer, not only have
left its address file behind (a head that crashed or was killed leaves it)."""

from __future__ import annotations

import socket
from pathlib import Path

from pipeline.doctor.environment import Status, _check_auto


def test_auto_with_a_live_head_is_ok(tmp_path: Path) -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        current = tmp_path / "ray_current_cluster"
        current.write_text(f"127.0.0.1:{listening.getsockname()[1]}\n")
        (finding,) = _check_auto(current, timeout_s=2)
    assert finding.status == Status.OK and "reachable" in finding.detail


def test_auto_with_the_file_of_a_dead_head_is_a_conflict(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once it is closed
    current = tmp_path / "ray_current_cluster"
    current.write_text(f"127.0.0.1:{port}\n")
    (finding,) = _check_auto(current, timeout_s=2)
    assert finding.status == Status.CONFLICT and "crashed or was killed" in finding.detail


def test_auto_with_no_file_is_a_conflict(tmp_path: Path) -> None:
    (finding,) = _check_auto(tmp_path / "absent", timeout_s=2)
    assert finding.status == Status.CONFLICT and "no Ray runs" in finding.detail
