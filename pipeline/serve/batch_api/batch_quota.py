"""Per-owner Batch API quotas that need a count shared by every ingress replica: batches in
flight and lines per UTC day (pipeline.serve.access.keys.BatchQuota; bytes stored is counted from
the owner's files themselves, pipeline.serve.batch_api.files.FileStore.stored_bytes).

The count is one small object per owner, `<batch_api.uri>/batches/<owner>/_quota.json`,

    {"day": "2026-12-01", "lines": 1200, "in_flight": ["batch_...", ...]}

changed only by compare-and-swap, so two replicas creating batches at once cannot both take
the last place. A batch takes its place before its record is written and its job submitted,
and gives it back if that fails. Places are freed lazily: only when the list is full are its
batches read (refreshed from Ray, at most max_batches_in_flight of them) and those that ended
(or whose record never came, the ingress having died in between) dropped, so nothing has to
run when a batch ends. Only keys with a quota pay for this.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable

from pipeline.openai.errors import ApiError
from pipeline.serve.access.keys import BatchQuota
from pipeline.serve.access.limits import retry_after_header
from pipeline.storage import OutputDir, PreconditionFailed
from pipeline.storage.prefix import Versioned

LEDGER = "_quota.json"
MAX_WRITES = 8  # compare-and-swap attempts before the request is answered 503
# Retry-After for a full batches-in-flight quota: a batch's end cannot be foreseen.
IN_FLIGHT_RETRY_S = 60


class QuotaLedger:
    """One owner's count (see the module docstring). Blocking: call it off the event loop."""

    def __init__(
        self, out: OutputDir, quota: BatchQuota, who: str, now: Callable[[], float]
    ) -> None:
        self.out = out
        self.quota = quota
        self.who = who  # the key's name, for messages
        self.now = now

    def reserve(self, batch_id: str, lines: int, ended: Callable[[str], bool]) -> None:
        """Count a new batch of `lines` requests, or raise the 429 (400) of the quota it
        would pass. `ended(batch_id)` says whether a batch counted before has ended."""
        quota = self.quota
        if quota.max_lines_per_day is not None and lines > quota.max_lines_per_day:
            raise ApiError(
                400,
                f"This batch has {lines} requests, more than key '{self.who}' may run in a "
                f"day ({quota.max_lines_per_day}); split the file",
                param="input_file_id",
                code="lines_per_day_exceeded",
            )
        for _ in range(MAX_WRITES):
            found = self.out.read_versioned(LEDGER)
            state = json.loads(found.data) if found is not None else {}
            day, used = self._today(state)
            in_flight = list(state.get("in_flight", []))
            limit = quota.max_batches_in_flight
            if limit is not None and len(in_flight) >= limit:
                in_flight = [b for b in in_flight if not ended(b)]
                if len(in_flight) >= limit:
                    raise _quota_error(
                        f"Batch limit reached for key '{self.who}': {limit} batches not yet "
                        "ended. Retry when one of them has ended (or cancel one).",
                        "batch_limit_exceeded",
                        IN_FLIGHT_RETRY_S,
                    )
            if quota.max_lines_per_day is not None and used + lines > quota.max_lines_per_day:
                raise _quota_error(
                    f"Daily limit reached for key '{self.who}': {used} of its "
                    f"{quota.max_lines_per_day} batch requests (lines) per UTC day are used "
                    f"and this batch has {lines}. Retry after midnight UTC.",
                    "lines_per_day_exceeded",
                    self._until_tomorrow_s(),
                )
            if limit is not None:
                in_flight.append(batch_id)
            if self._write(found, {"day": day, "lines": used + lines, "in_flight": in_flight}):
                return
        raise _busy()

    def release(self, batch_id: str, lines: int) -> None:
        """Give back what `reserve` took for a batch that was not created after all."""
        for _ in range(MAX_WRITES):
            found = self.out.read_versioned(LEDGER)
            if found is None:
                return
            state = json.loads(found.data)
            day, used = self._today(state)
            if state.get("day") == day:
                used = max(0, used - lines)
            in_flight = [b for b in state.get("in_flight", []) if b != batch_id]
            if self._write(found, {"day": day, "lines": used, "in_flight": in_flight}):
                return
        raise _busy()

    def _today(self, state: dict) -> tuple[str, int]:
        day = dt.datetime.fromtimestamp(self.now(), dt.timezone.utc).date().isoformat()
        return day, int(state.get("lines", 0)) if state.get("day") == day else 0

    def _until_tomorrow_s(self) -> float:
        now = dt.datetime.fromtimestamp(self.now(), dt.timezone.utc)
        tomorrow = dt.datetime.combine(
            now.date() + dt.timedelta(days=1), dt.time(), tzinfo=dt.timezone.utc
        )
        return (tomorrow - now).total_seconds()

    def _write(self, found: Versioned | None, state: dict) -> bool:
        data = json.dumps(state).encode()
        try:
            if found is None:
                self.out.create(LEDGER, data)
            else:
                self.out.replace(LEDGER, data, found.version)
            return True
        except PreconditionFailed:  # another replica counted first: count again
            return False


def _quota_error(message: str, code: str, retry_after_s: float) -> ApiError:
    headers = {"Retry-After": retry_after_header(retry_after_s)}
    return ApiError(429, message, type="requests", code=code, headers=headers)


def _busy() -> ApiError:
    return ApiError(
        503,
        "The batch quota is being changed by several requests at once; retry shortly",
        type="server_error",
        code="conflict",
    )
