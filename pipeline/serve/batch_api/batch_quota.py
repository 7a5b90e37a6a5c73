"""Per-owner Batch API quotas that need a count shared by every ingress replica: batches in
flight, lines per UTC day, and the bytes of uploads in progress
(pipeline.serve.access.keys.BatchQuota).

The count is one small object per owner, `<batch_api.uri>/batches/<owner>/_quota.json`,

    {"day": "2026-12-01", "lines": 1200, "in_flight": ["batch_...", ...],
     "uploads": {"file-...": {"bytes": 1048576, "until": 1796525742.0}}, "write_id": "..."}

changed only by compare-and-swap, so two replicas creating batches at once cannot both take
the last place. Every write carries a fresh write_id: two replicas that would write the same
count (each adding 20 lines to 10) still write different bytes, so the one that lost the race
is not mistaken for a retry of its own write that landed (pipeline.storage.prefix).

A batch takes its place before its record is written and its job submitted, and gives it back
only if surely no job runs. Places are freed lazily: only when the list is full are its
batches read (refreshed from Ray, at most max_batches_in_flight of them) and those that ended
(or whose record never came, the ingress having died in between) dropped, so nothing has to
run when a batch ends.

Bytes stored are the owner's files (pipeline.serve.batch_api.files.FileStore.stored_bytes)
plus what the uploads in progress have reserved: an upload reserves bytes as they arrive,
before it writes them, so uploads running side by side on any replicas never store more than
max_stored_bytes together. A reservation names its end (`until`), renewed while its upload
sends; one whose replica died stops counting then. Only keys with a quota pay for this.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable
from typing import Any

from pipeline.openai.errors import ApiError
from pipeline.serve.access.keys import BatchQuota
from pipeline.serve.access.limits import retry_after_header
from pipeline.storage import OutputDir, PreconditionFailed
from pipeline.storage.prefix import Versioned

LEDGER = "_quota.json"
MAX_WRITES = 8  # compare-and-swap attempts before the request is answered 503
# Retry-After for a full batches-in-flight quota: a batch's end cannot be foreseen.
IN_FLIGHT_RETRY_S = 60
# An upload's reservation lasts this long past its last renewal; a live upload renews it at
# least every UPLOAD_RENEW_S while it sends (and is cut after http.body_idle_timeout_s without
# data), so only a dead replica's reservation runs out.
UPLOAD_RESERVATION_TTL_S = 300.0
UPLOAD_RENEW_S = 60.0
# Retry-After for a full storage quota: room comes back when uploads in progress end or files
# are deleted.
STORAGE_FULL_RETRY_S = 5


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
            found, state = self._read()
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
            state.update(day=day, lines=used + lines, in_flight=in_flight)
            if self._write(found, state):
                return
        raise _busy()

    def release(self, batch_id: str, lines: int) -> None:
        """Give back what `reserve` took for a batch that was not created after all."""
        for _ in range(MAX_WRITES):
            found, state = self._read()
            if found is None:
                return
            day, used = self._today(state)
            if state.get("day") == day:
                used = max(0, used - lines)
            in_flight = [b for b in state.get("in_flight", []) if b != batch_id]
            state.update(day=day, lines=used, in_flight=in_flight)
            if self._write(found, state):
                return
        raise _busy()

    def reserve_bytes(self, upload_id: str, need: int, want: int, stored: Callable[[], int]) -> int:
        """Hold bytes for the upload `upload_id`: `want` if its owner's files (`stored()`)
        and the other uploads in progress leave room, else what is left if that is at least
        `need`, else 429 storage_limit_exceeded. Returns what it holds; calling it again
        grows (or renews) the reservation."""
        limit = self.quota.max_stored_bytes
        if limit is None:
            return want
        for _ in range(MAX_WRITES):
            found, state = self._read()
            now = self.now()
            uploads = {
                name: held
                for name, held in (state.get("uploads") or {}).items()
                if float(held.get("until", 0)) > now  # a dead replica's runs out
            }
            others = sum(int(held["bytes"]) for name, held in uploads.items() if name != upload_id)
            files = stored()
            room = limit - files - others
            if room < need:
                raise storage_full(self.who, limit, files, others, need)
            total = min(want, room)
            uploads[upload_id] = {"bytes": total, "until": now + UPLOAD_RESERVATION_TTL_S}
            state["uploads"] = uploads
            if self._write(found, state):
                return total
        raise _busy()

    def release_bytes(self, upload_id: str) -> None:
        """Drop an upload's reservation (it was stored, now counted from its file, or it
        failed)."""
        for _ in range(MAX_WRITES):
            found, state = self._read()
            uploads = dict(state.get("uploads") or {})
            if found is None or uploads.pop(upload_id, None) is None:
                return
            state["uploads"] = uploads
            if self._write(found, state):
                return
        raise _busy()

    def _read(self) -> tuple[Versioned | None, dict[str, Any]]:
        found = self.out.read_versioned(LEDGER)
        return found, (json.loads(found.data) if found is not None else {})

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
        data = json.dumps({**state, "write_id": uuid.uuid4().hex}).encode()
        try:
            if found is None:
                self.out.create(LEDGER, data)
            else:
                self.out.replace(LEDGER, data, found.version)
            return True
        except PreconditionFailed:  # another replica counted first: count again
            return False


def storage_full(who: str, limit: int, stored: int, reserved: int, upload: int) -> ApiError:
    """429 for an upload that would take its owner past max_stored_bytes."""
    return _quota_error(
        f"Storage limit reached for key '{who}': its files would hold more than its {limit} "
        f"bytes ({stored} stored, {reserved} reserved by uploads in progress, this upload "
        f"{upload} so far). Delete files it no longer needs (DELETE /v1/files/{{file_id}}), "
        "then upload again.",
        "storage_limit_exceeded",
        STORAGE_FULL_RETRY_S,
    )


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
