"""The skeleton the production engine adapters (engines/vllm.py, engines/trtllm.py) share.

Each adapter wraps a vendor engine that batches requests itself and reports per-request
outputs; what is the same whatever the vendor lives here, so the adapter modules keep only
what is specific to their vendor's API:

- `VendorAdapter`: settings the vendor refuses (`_loading`), the request bookkeeping
  (requests in flight, finished count, shut-down and stopped states), how a failure of one
  request becomes a row error or a dead engine (`_failed`), `abort`, `drain_step_records`
  (no step records) and `shutdown`;
- `declared_settings` / `check_settings`: an engine's accepted settings are the keyword
  parameters of its constructor, listed nowhere else;
- `import_vendor`: the lazy import of the vendor library, with its install hint;
- finish-reason tables, vendor time points and the clock-base check, and the request
  metrics of a request the vendor reported no timing for.

No vendor library is imported here (nor Ray, nor `pipeline`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from engines.api import (
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    StepRecord,
    StreamDelta,
)
from engines.requests import error_result

# --- settings ----------------------------------------------------------------------------------


def declared_settings(init: Callable[..., Any], *more: str) -> tuple[str, ...]:
    """The settings an engine accepts: the keyword-only parameters of its constructor `init`
    (in order), then `more` (names its `**kwargs` takes, such as pass-through vendor args)."""
    params = inspect.signature(init).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY) + more


def check_settings(
    engine: str,
    given: Iterable[str],
    accepted: tuple[str, ...],
    *,
    also_allowed: Iterable[str] = (),
    also: str = "",
) -> None:
    """Raise a TypeError naming the settings in `given` that are neither `accepted` nor
    `also_allowed` (which `also` describes, such as the vendor's own arguments passed
    through): a typo in a job file cannot pass silently."""
    unknown = sorted(set(given) - set(accepted) - set(also_allowed))
    if unknown:
        raise TypeError(
            f"{engine} got unknown setting(s) {', '.join(unknown)}; accepted: "
            f"{', '.join(accepted)}{also}"
        )


# --- the vendor library ------------------------------------------------------------------------


def import_vendor(module: str, *, kind: str, product: str, version: str, hint: str) -> Any:
    """Import the vendor library `module` for engine.kind `kind`; an EngineError saying what
    to install (`hint`) when it is missing. Called inside the adapter's constructor: the
    library is an optional install, and some need a GPU stack at import time."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EngineError(
            f"engine.kind {kind} needs {product} {version}.x, which is not installed ({exc}); "
            f"{hint}"
        ) from exc


# --- outputs -----------------------------------------------------------------------------------


def finish_reasons(**more: FinishReason) -> dict[str, FinishReason]:
    """A vendor's finish reasons → ours: "stop" and "length" as they are, plus `more` (the
    vendor's name for a cancelled request). A reason missing from the table is a row error."""
    return {"stop": "stop", "length": "length", **more}


def finished_delta(result: GenerationResult) -> StreamDelta:
    """The last delta of a stream that ends without further tokens (an error, a refusal)."""
    return StreamDelta(token_ids=[], text="", finished=True, result=result)


# --- timing ------------------------------------------------------------------------------------


def time_point(value: Any) -> float | None:
    """A vendor timestamp in seconds (a float, or a timedelta on the steady clock); None when
    unset: None, or zero (the vendors' "never reached")."""
    if value is None:
        return None
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else float(value or 0.0)
    return seconds if seconds > 0.0 else None


def same_clock(theirs: float, ours: float, tolerance_s: float) -> bool:
    """Whether a vendor timestamp is on our time.monotonic() base. On Linux CLOCK_MONOTONIC
    (C++'s steady_clock) is shared by every process of the machine, so one taken there lands
    within `tolerance_s` of ours; one further off is on another base."""
    return abs(theirs - ours) < tolerance_s


def untimed_metrics(arrival: float, now: float, has_tokens: bool) -> RequestMetrics:
    """Metrics of a request the vendor gave no timing for: scheduled on arrival and its first
    token by now when it produced any (they did arrive), finished now."""
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=arrival if has_tokens else None,
        first_token_time=now if has_tokens else None,
        finish_time=now,
    )


# --- the adapter -------------------------------------------------------------------------------


class VendorAdapter:
    """Bookkeeping and failure handling of an engines.api.Engine over a vendor engine.

    A subclass sets `vendor` (its name in messages), calls `_init_bookkeeping()` once its
    vendor engine (`self._llm`, which has `shutdown()`) is loaded, registers each request in
    `self._live` (request_id -> its vendor handle) while it runs, implements `_row_error(exc)`
    (the row-error text when `exc` is that request's own fault, else None), and may override:
    - `_dead_reason()` / `_stop_cause(exc)`: the vendor says its engine has stopped;
    - `_engine_failure(exc)`: any other failure (by default the engine is dead from then on);
    - `_abort_live(request_id, handle)` / `_cancel_on_shutdown(handle)`: cancel one request
      in flight (by default `handle.abort()`).
    """

    vendor: ClassVar[str]
    _llm: Any

    def _init_bookkeeping(self) -> None:
        self._live: dict[str, Any] = {}  # request_id -> the vendor's handle while in flight
        self._num_finished = 0
        self._closed = False
        self._dead: str | None = None  # why the vendor engine stopped

    @contextmanager
    def _loading(self, model: str) -> Iterator[None]:
        """Around building the vendor engine: its refusing the settings (ValueError,
        TypeError) is an EngineError naming the model."""
        try:
            yield
        except (ValueError, TypeError) as exc:
            raise EngineError(
                f"{self.vendor} rejected the engine settings for {model}: {exc}"
            ) from exc

    # --- state ---------------------------------------------------------------------------------

    def _dead_reason(self) -> str | None:
        """Why the vendor engine has stopped, or None while it runs."""
        return self._dead

    def _check_alive(self, shut_down: str = "") -> None:
        """Raise EngineDeadError when no request can run any more (`shut_down` ends the
        message for a shut-down engine)."""
        if self._closed:
            raise EngineDeadError(f"the {self.vendor} engine is shut down{shut_down}")
        reason = self._dead_reason()
        if reason is not None:
            raise self._stopped(reason)

    def _raise_if_dead(self) -> None:
        """For stats(): EngineDeadError once the vendor engine has stopped on its own (a
        clean shutdown is not a death: stats stay readable after it)."""
        reason = None if self._closed else self._dead_reason()
        if reason is not None:
            raise self._stopped(reason)

    def _stopped(self, reason: str) -> EngineDeadError:
        return EngineDeadError(f"the {self.vendor} engine has stopped: {reason}")

    def _mark_dead(self, exc: BaseException) -> EngineDeadError:
        """Record that the vendor engine is broken by `exc`; the error to raise."""
        self._dead = f"{type(exc).__name__}: {exc}"
        return self._stopped(self._dead)

    # --- failures ------------------------------------------------------------------------------

    def _failed(
        self, request: GenerationRequest, exc: Exception, arrival: float
    ) -> GenerationResult:
        """A failure of this request alone is a row error (timed from `arrival`); a failure of
        the engine raises (EngineDeadError once it cannot serve any further request)."""
        if self._closed:
            raise EngineDeadError(f"the {self.vendor} engine is shut down: {exc}") from exc
        cause = self._stop_cause(exc)
        if cause is not None:
            raise self._stopped(cause) from exc
        message = self._row_error(exc)
        if message is not None:
            return error_result(request, message, arrival)
        raise self._engine_failure(exc) from exc

    def _stop_cause(self, exc: Exception) -> str | None:
        """Why the vendor engine has stopped, when `exc` (or the vendor) says it has."""
        return None

    def _row_error(self, exc: Exception) -> str | None:
        raise NotImplementedError

    def _engine_failure(self, exc: Exception) -> EngineError:
        return self._mark_dead(exc)

    # --- the Engine methods both share -------------------------------------------------------

    def abort(self, request_id: str) -> None:
        handle = self._live.get(request_id)
        if handle is not None:
            self._abort_live(request_id, handle)

    def _abort_live(self, request_id: str, handle: Any) -> None:
        handle.abort()  # the vendor's per-request handle (TensorRT-LLM's RequestOutput)

    def drain_step_records(self) -> list[StepRecord]:
        return []  # the vendors report per-request timing only

    def shutdown(self) -> None:
        """Stop the vendor engine; requests in flight end (as "cancelled"), later ones raise
        EngineDeadError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._live.values()):
            self._cancel_on_shutdown(handle)
        self._llm.shutdown()

    def _cancel_on_shutdown(self, handle: Any) -> None:
        handle.abort()
