"""The skeleton the vLLM and TensorRT-LLM adapters share (engines/adapter.py), without either
vendor library: failures become row errors or a dead engine, vendor time points, metrics."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from engines.adapter import (
    VendorAdapter,
    finish_reasons,
    import_vendor,
    same_clock,
    time_point,
    untimed_metrics,
)
from engines.api import EngineDeadError, EngineError, GenerationRequest


class _Handle:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class _Llm:
    def __init__(self) -> None:
        self.shut = 0

    def shutdown(self) -> None:
        self.shut += 1


class _Fake(VendorAdapter):
    vendor = "Fake"

    def __init__(self) -> None:
        self._llm = _Llm()
        self._init_bookkeeping()

    def _row_error(self, exc: Exception) -> str | None:
        return f"row: {exc}" if isinstance(exc, ValueError) else None


def test_a_request_failure_is_a_row_error_and_any_other_kills_the_engine() -> None:
    engine = _Fake()
    request = GenerationRequest([1, 2])
    result = engine._failed(request, ValueError("bad"), time.monotonic())
    assert (result.finish_reason, result.error) == ("error", "row: bad")
    with pytest.raises(EngineDeadError, match="the Fake engine has stopped: RuntimeError: boom"):
        engine._failed(request, RuntimeError("boom"), time.monotonic())
    with pytest.raises(EngineDeadError, match="has stopped: RuntimeError: boom"):
        engine._check_alive()


def test_shutdown_cancels_the_requests_in_flight_once() -> None:
    engine = _Fake()
    handle = engine._live["r1"] = _Handle()
    engine.abort("r1")
    engine.abort("unknown")
    assert handle.aborted == 1
    engine.shutdown()
    engine.shutdown()
    assert handle.aborted == 2 and engine._llm.shut == 1
    assert engine.drain_step_records() == []
    with pytest.raises(EngineDeadError, match="the Fake engine is shut down; load"):
        engine._check_alive("; load a new engine")
    with pytest.raises(EngineDeadError, match="is shut down: late"):
        engine._failed(GenerationRequest([1]), ValueError("late"), 0.0)


def test_time_points() -> None:
    assert time_point(None) is None
    assert time_point(0.0) is None and time_point(dt.timedelta(0)) is None
    assert time_point(2.5) == 2.5 and time_point(dt.timedelta(seconds=3)) == 3.0
    assert same_clock(100.0, 104.0, 5.0) and not same_clock(100.0, 106.0, 5.0)


def test_untimed_metrics() -> None:
    m = untimed_metrics(10.0, 12.0, has_tokens=True)
    assert (m.first_scheduled_time, m.first_token_time, m.finish_time) == (10.0, 12.0, 12.0)
    m = untimed_metrics(10.0, 12.0, has_tokens=False)
    assert (m.first_scheduled_time, m.first_token_time, m.finish_time) == (None, None, 12.0)


def test_finish_reasons_and_the_install_hint() -> None:
    assert finish_reasons(abort="cancelled") == {
        "stop": "stop",
        "length": "length",
        "abort": "cancelled",
    }
    with pytest.raises(EngineError, match=r"engine.kind x needs X 1.2.x, which is not .*; get it"):
        import_vendor("no_such_vendor_lib", kind="x", product="X", version="1.2", hint="get it")


def test_vllm_metrics_keep_timestamps_on_our_clock_only() -> None:
    """engines.vllm imports vLLM only when an engine is built: its mapping runs here too."""
    from engines.vllm import _metrics

    class Stats:
        scheduled_ts = 99.0
        first_token_ts = 100.5

    m = _metrics(Stats(), 98.0, 101.0, has_tokens=True)
    assert (m.first_scheduled_time, m.first_token_time, m.finish_time) == (99.0, 100.5, 101.0)

    class Elsewhere:
        scheduled_ts = 5_000.0  # another clock base: dropped
        first_token_ts = 0.0  # unset

    m = _metrics(Elsewhere(), 98.0, 101.0, has_tokens=True)
    assert (m.first_scheduled_time, m.first_token_time) == (98.0, 101.0)
    m = _metrics(None, 98.0, 101.0, has_tokens=False)
    assert (m.first_scheduled_time, m.first_token_time, m.finish_time) == (None, None, 101.0)
