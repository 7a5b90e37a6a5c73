"""The run lease: one run at a time may commit to an output prefix.

`_lease.json` at the prefix names the run that holds it (run id, attempt, host, pid, start).

- acquire: create the object only if it is absent (S3 `If-None-Match: *`; a hard link on a
  local filesystem). If it exists and was renewed within `lease_timeout_s` (by the store's own
  clock: the object's age), the output is busy: `LeaseHeld` names the running attempt, its
  host and pid, when it last renewed and when the lease may be taken over. A lease older than
  the timeout belonged to a run that stopped renewing (its driver died or hangs): it is taken
  over by a conditional replace of exactly that version (`If-Match`), so of two drivers taking
  over at once only one wins. A lease whose holder ran on this very machine (same boot and
  process namespace) and whose process is gone is taken over at once: that driver is dead for
  certain, and a rerun after a crash should not wait out the timeout.
- renew: a conditional replace of the version this run wrote last, every third of the timeout.
  If it fails, another run took the lease over: `LeaseLost`, and this run must stop at once.
  Transient failures are retried for a sixth of the timeout only (not `storage.retry_s`): a
  renewal that cannot get through gives up, and the run stops, at most half a timeout after
  the last renewal that did, well before another run may take the lease over.
- release: delete it if it is still the version this run wrote last, in one conditional
  request (S3 `If-Match` on DELETE; locally under the lock the compare-and-swap takes), so a
  lease another run took over meanwhile stays. Where the store ignores If-Match on DELETE
  (probed at acquire), release instead marks the lease released by a conditional replace, and
  acquire takes a released lease over at once.

The manifest is written the same way (compare-and-swap on its version), so a run that lost its
lease can no longer record a part: its late parts are never counted.

Stores that ignore conditional writes cannot fence: `acquire` then works unfenced and says so
(`Lease.fenced` is False); one driver per output is then the operator's job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.batch.commit.parts import LEASE_NAME
from pipeline.storage import OutputDir, PreconditionFailed, RetryPolicy

logger = logging.getLogger(__name__)

# Renewals are retried for this fraction of the lease timeout (see the module docstring).
RENEW_RETRY_FRACTION = 1 / 6


class LeaseHeld(RuntimeError):
    """Another run holds the output's lease; the message says which and until when."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over: it must stop committing."""


def _machine_id() -> str:
    """This boot of this machine and this process namespace: a pid means the same process
    only where both match (containers on one host share the boot id, not the namespace)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}"


def _process_gone(pid: int) -> bool:
    """Whether no live process has this pid here (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


@dataclass(frozen=True)
class LeaseHolder:
    """What `_lease.json` says about the run that holds it."""

    run_id: str
    attempt: int | None  # filled once the holder has numbered its run
    host: str
    pid: int
    started_at: float  # epoch seconds
    timeout_s: float
    machine: str = ""  # _machine_id() of the holder ("" when unknown)
    released: bool = False  # the run gave the lease up (stores without conditional deletes)

    def is_dead_here(self) -> bool:
        """The holder ran on this machine and its process is gone."""
        here = _machine_id()
        return bool(here) and self.machine == here and self.pid > 0 and _process_gone(self.pid)

    def to_bytes(self) -> bytes:
        """The lease's content for one write: `write_id` makes every write's bytes its own (a
        retried write recognises them on storage: pipeline.storage.prefix)."""
        fields = {**asdict(self), "renewed_at": time.time(), "write_id": uuid.uuid4().hex}
        return json.dumps(fields).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseHolder | None:
        try:
            raw = json.loads(data)
            return cls(
                str(raw["run_id"]),
                raw.get("attempt"),
                str(raw.get("host", "?")),
                int(raw.get("pid", 0)),
                float(raw.get("started_at", 0.0)),
                float(raw.get("timeout_s", 0.0)),
                str(raw.get("machine", "")),
                bool(raw.get("released", False)),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        attempt = f"attempt {self.attempt}" if self.attempt is not None else "a starting run"
        return f"{attempt} (run {self.run_id[:8]}) on host {self.host}, pid {self.pid}"


def new_holder(timeout_s: float) -> LeaseHolder:
    return LeaseHolder(
        run_id=uuid.uuid4().hex,
        attempt=None,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=time.time(),
        timeout_s=timeout_s,
        machine=_machine_id(),
    )


class Lease:
    """A held lease on one output prefix (see the module docstring)."""

    def __init__(
        self,
        out: OutputDir,
        holder: LeaseHolder,
        version: str,
        fenced: bool,
        conditional_deletes: bool = True,
    ):
        self.out = out
        self.conditional_deletes = conditional_deletes  # the store honours If-Match on DELETE
        bound = holder.timeout_s * RENEW_RETRY_FRACTION
        self._renewing = out.with_retries(
            RetryPolicy(min(out.retry.total_s, bound), first_delay_s=min(0.5, bound / 8))
            if out.retry is not None
            else None
        )
        self.holder = holder
        self.version = version
        self.fenced = fenced
        self.taken_over: LeaseHolder | None = None  # the dead run this lease was taken from
        self._lock = threading.Lock()
        self._lost: str | None = None

    @property
    def run_id(self) -> str:
        return self.holder.run_id

    @property
    def lost(self) -> str | None:
        """Why the lease was lost (None while it is held)."""
        return self._lost

    @classmethod
    def acquire(cls, out: OutputDir, timeout_s: float) -> Lease:
        """Take the output's lease or raise LeaseHeld (see the module docstring)."""
        holder = new_holder(timeout_s)
        fenced = out.supports_conditional_writes()
        deletes = fenced and out.supports_conditional_deletes()
        if not fenced:
            logger.warning(
                "%s: the store ignores conditional writes (If-None-Match), so two runs on this "
                "output cannot be fenced; run one driver per output (tokenmill submit gives "
                "each night one submission)",
                out.uri,
            )
        for _ in range(3):  # a lease that vanishes or changes between our steps: look again
            try:
                version = out.create(LEASE_NAME, holder.to_bytes())
                return cls(out, holder, version, fenced, deletes)
            except PreconditionFailed:
                pass
            current = out.read_versioned(LEASE_NAME)
            if current is None:
                continue
            other = LeaseHolder.parse(current.data)
            timeout = max(timeout_s, other.timeout_s if other else 0.0)
            dead = other is not None and other.is_dead_here()
            free = dead or (other is not None and other.released)
            if current.age_s < timeout and not free:
                who = other.describe() if other else "another run"
                raise LeaseHeld(
                    f"{out.uri} is being written by {who}: it renewed its lease "
                    f"{current.age_s:.0f}s ago. Wait for it to finish, or, if that run is "
                    f"dead, rerun after its lease expires ({timeout:.0f}s without renewal, "
                    f"about {max(timeout - current.age_s, 0):.0f}s from now; "
                    "output.lease_timeout_s). Two runs must not write one output."
                )
            try:
                version = out.replace(LEASE_NAME, holder.to_bytes(), current.version)
            except PreconditionFailed:
                continue  # someone renewed or took it over meanwhile: look again
            lease = cls(out, holder, version, fenced, deletes)
            lease.taken_over = other
            if other is not None and other.released:
                logger.info("%s: took the lease %s had released", out.uri, other.describe())
                return lease
            logger.warning(
                "%s: took over the lease of %s, %s",
                out.uri,
                other.describe() if other else "an unreadable lease",
                "whose process is gone"
                if dead
                else f"which had not renewed for {current.age_s:.0f}s",
            )
            return lease
        raise LeaseHeld(f"{out.uri}: the lease kept changing while this run tried to take it")

    def set_attempt(self, attempt: int) -> None:
        """Record the run's attempt number in the lease (so a refused run can name it)."""
        self.holder = LeaseHolder(**{**asdict(self.holder), "attempt": attempt})
        self.renew()

    def renew(self) -> None:
        """Renew the lease; raises LeaseLost if another run took it over."""
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            try:
                self.version = self._renewing.replace(
                    LEASE_NAME, self.holder.to_bytes(), self.version
                )
            except PreconditionFailed:
                self._lost = (
                    f"{self.out.uri}: this run's lease was taken over by another run (it was not "
                    f"renewed within {self.holder.timeout_s:.0f}s); this run stops without "
                    "committing more"
                )
                raise LeaseLost(self._lost) from None

    def verify(self) -> None:
        """Raise LeaseLost unless `_lease.json` still names this run (one read). Called before
        every manifest write, so a run that hung past its timeout and woke up finds out before
        it writes, not after."""
        current = self.out.read_versioned(LEASE_NAME)
        holder = LeaseHolder.parse(current.data) if current else None
        if holder is None or holder.run_id != self.run_id or holder.released:
            who = holder.describe() if holder and not holder.released else "no run (released)"
            self.mark_lost(f"{self.out.uri}: the lease is now held by {who}")
            raise LeaseLost(self._lost or "lease lost")

    def mark_lost(self, reason: str) -> None:
        with self._lock:
            self._lost = self._lost or reason

    def release(self) -> None:
        """Give the lease up, only if it is still ours (see the module docstring)."""
        with self._lock:
            if self._lost:
                return
            self._lost = "released"
            try:
                if not self.fenced:  # nothing is conditional on this store
                    current = self.out.read_versioned(LEASE_NAME)
                    if current is not None and current.version == self.version:
                        self.out.delete(LEASE_NAME)
                elif self.conditional_deletes:
                    self.out.delete_if(LEASE_NAME, self.version)
                else:
                    gone = dataclasses.replace(self.holder, released=True)
                    self.out.replace(LEASE_NAME, gone.to_bytes(), self.version)
            except PreconditionFailed:
                logger.info("%s: the lease is another run's now; left as it is", self.out.uri)


class LeaseKeeper:
    """Renews a lease every third of its timeout from a daemon thread until stopped; a failed
    renewal (lease lost, or storage failing past its retries) sets `failure` and `on_lost`."""

    def __init__(self, lease: Lease, on_lost: threading.Event):
        self.lease = lease
        self.on_lost = on_lost
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)

    def _loop(self) -> None:
        interval = self.lease.holder.timeout_s / 3.0
        while not self._stop.wait(interval):
            try:
                self.lease.renew()
            except Exception as exc:
                self.failure = f"{type(exc).__name__}: {exc}"
                self.lease.mark_lost(self.failure)
                self.on_lost.set()
                return

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
