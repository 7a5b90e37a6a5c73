"""The driver's side of the commit protocol for one run on one output prefix.

    open    read the manifest (refuse another job's output, or another protocol's), adopt
            the parts a crashed run wrote but did not record, number this run, record it
    commit  every part an engine actor reports goes through the ledger; accepted parts are
            written into the manifest at least every `output.commit_interval_s`
    finish  record the run, the totals (from the manifest alone) and the status; then
            delete the part files that manifest does not list (refused duplicates, replaced
            parts, a crashed run's leftovers, a fenced-off run's late parts); `_SUCCESS` last,
            when every input row of every shard is committed

Every manifest write is a compare-and-swap under the run's lease, so nothing here can commit
after another run took the output over. Deleting cannot be made conditional on the lease (the
lease is another object), and a driver can stall between any two requests (a GC pause, a
stopped container) and wake after another run took the output over. So a run deletes only
what no other run can hold committed:

- it checks the lease before it deletes anything, and deletes files only after the manifest
  write that settles them (the compare-and-swap fails if another run wrote since);
- a run whose end is recorded (`finished_at`) has settled its parts and every earlier run's:
  a part of such a run that the manifest does not list is garbage, and no later run adopts it;
- it never deletes a part of a run numbered above its own (only a run that took over numbers
  itself higher), nor, while adopting, a part of a run it does not know.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines import faults
from pipeline.batch.commit.fingerprint import Fingerprint
from pipeline.batch.commit.lease import Lease, LeaseLost
from pipeline.batch.commit.ledger import CommitLedger, Decision
from pipeline.batch.commit.manifest import (
    PROTOCOL,
    Manifest,
    ManifestStore,
    RunRecord,
    Status,
    manifest_protocol,
    spec_snapshot,
    utc_now,
)
from pipeline.batch.commit.parts import (
    MANIFEST_NAME,
    SUCCESS_NAME,
    PartName,
    PartWritten,
    list_part_names,
    read_part_record,
)
from pipeline.batch.commit.stats import RowStats, SpecCounts
from pipeline.batch.units import ShardPlan
from pipeline.cost import ActorAccount, job_totals
from pipeline.spec import JobSpec
from pipeline.storage import OutputDir, PreconditionFailed

logger = logging.getLogger(__name__)


class ResumeRefused(RuntimeError):
    """The output prefix holds rows made differently (or unknown rows); nothing was changed."""


@dataclass
class OpenedOutput:
    """What `Committer.open` found: the previous manifest and whether it says complete."""

    previous: Manifest | None
    already_complete: bool


class Committer:
    """See the module docstring. One per run; the caller holds the lease."""

    def __init__(
        self,
        out: OutputDir,
        spec: JobSpec,
        plan: ShardPlan,
        fingerprint: Fingerprint,
        schema: list[list[str]],
        input_files: list[dict[str, Any]],
        lease: Lease,
    ):
        self.out = out
        self.spec = spec
        self.plan = plan
        self.fingerprint = fingerprint
        self.schema = schema
        self.input_files = input_files
        self.lease = lease
        self.fenced = lease.fenced
        self.store = ManifestStore(out)
        self.ledger = CommitLedger(plan)
        self.manifest: Manifest | None = None
        self.run: RunRecord | None = None
        self.rows_committed = 0  # by this run
        self.parts_committed = 0
        self.completion_tokens = 0
        self.error_rows = 0
        self.refused: list[str] = []  # part files the ledger refused (deleted at finish)
        self.duplicate_ids: dict[str, Any] | None = None  # this run's cross-shard check
        self._last_save = 0.0

    # --- open --------------------------------------------------------------------------------

    def clear(self) -> None:
        """--fresh: delete this job's manifest, parts and marker; other files stay.

        The manifest goes first, by a conditional delete of the version read before the
        lease was checked: a run that took the output over has rewritten it since, and then
        nothing is deleted (LeaseLost); a run taking over later finds parts without a
        manifest and refuses to touch them."""
        current = self.out.read_versioned(MANIFEST_NAME)
        self.lease.verify()  # LeaseLost: another run took the output over meanwhile
        if current is not None:
            try:
                if self.lease.conditional_deletes:
                    self.out.delete_if(MANIFEST_NAME, current.version)
                else:
                    self.out.delete(MANIFEST_NAME)
            except PreconditionFailed:
                reason = f"{self.out.uri}: another run wrote the manifest while --fresh cleared it"
                self.lease.mark_lost(reason)
                raise LeaseLost(reason) from None
        for name in [*list_part_names(self.out), SUCCESS_NAME]:
            self.out.delete(name)

    def open(self) -> OpenedOutput:
        """Check the prefix against this job (ResumeRefused if it holds another's rows) and
        load what it has committed."""
        text = self.store.read_text()
        parts_on_disk = list_part_names(self.out)
        if text is None:
            if parts_on_disk:
                raise ResumeRefused(
                    f"{self.out.uri} holds part files but no _manifest.json, so they cannot be "
                    "checked against this job; rerun with --fresh to replace them, or use "
                    "another output.uri"
                )
            return OpenedOutput(None, False)
        protocol = manifest_protocol(text)
        if protocol != PROTOCOL:
            raise ResumeRefused(
                f"{self.out.uri} was written by another version of tokenmill (commit protocol "
                f"{protocol}, this one writes {PROTOCOL}); rerun with --fresh to start over, or "
                "set output.uri to a new prefix"
            )
        previous = self.store.read()
        if previous is None:
            raise ResumeRefused(f"{self.out.uri}/{MANIFEST_NAME} cannot be parsed; use --fresh")
        before = Fingerprint.from_json(previous.fingerprint)
        if before.value != self.fingerprint.value:
            changed = self.fingerprint.changed_components(before)
            raise ResumeRefused(
                f"{self.out.uri} was written by a different job: {', '.join(changed)} changed "
                f"since (job {previous.job!r}, {len(previous.runs)} run(s)). Mixing the rows "
                "would make the output inconsistent; rerun with --fresh to start over (deletes "
                "its parts), or set output.uri to a new prefix"
            )
        self.ledger = CommitLedger(self.plan, RowStats.from_json(previous.stats))
        counts = {
            int(s["index"]): int(s["num_rows"])
            for s in previous.shards
            if s.get("num_rows") is not None
        }
        self.ledger.restore(previous.part_records(), counts)
        self.manifest = previous
        complete = previous.status == "complete" and self.out.exists(SUCCESS_NAME)
        return OpenedOutput(previous, complete)

    def adopt_orphans(self) -> list[str]:
        """Record the parts an earlier run wrote but did not get into the manifest (its driver
        died between the two), from their footers; delete part files that cannot be adopted.
        Called once, before this run writes any part.

        Only parts of runs that did not record their end can be adopted: a finished run's
        unlisted parts are garbage it may be deleting right now. Parts of a run the manifest
        does not name belong to a run that started after it was read (one that took the
        output over): they are left alone."""
        runs = self.manifest.runs if self.manifest else []
        listed = set(self.ledger.parts)
        earlier = {r.attempt for r in runs}
        settled = settled_attempt(runs)
        self.lease.verify()  # LeaseLost before anything is deleted if the output was taken
        adopted = []
        for name in list_part_names(self.out):
            if name in listed:
                continue
            part = PartName.parse(name)
            if part is None or part.run > max(earlier, default=0):
                continue  # a newer run's (see the docstring)
            record = read_part_record(self.out, name)
            ok = (
                record is not None
                and record.name == name
                and record.replaces is None
                and part.run in earlier
                and part.run > settled
            )
            if ok and record is not None:
                size, version = self.out.stat(name)
                record = dataclasses.replace(record, size_bytes=size, version=version)
                if self.ledger.accept(record) is Decision.ACCEPTED:
                    adopted.append(name)
                    continue
            logger.warning("%s/%s is not a committed part; deleting it", self.out.uri, name)
            self.out.delete(name)
        return adopted

    def begin(self, mode: str, run_id: str, host: str, pid: int) -> RunRecord:
        """Number this run, record it in the manifest (status running) and drop `_SUCCESS`."""
        earlier = [r.attempt for r in self.manifest.runs] if self.manifest else []
        seen = [p.run for p in (PartName.parse(n) for n in list_part_names(self.out)) if p]
        attempt = max([0, *earlier, *seen]) + 1  # never reuse a number, even a crashed run's
        self.run = RunRecord(
            attempt=attempt, started_at=utc_now(), mode=mode, run_id=run_id, host=host, pid=pid
        )
        runs = [*(self.manifest.runs if self.manifest else []), self.run]
        for record in runs[:-1]:
            if record.finished_at is None:
                record.interrupted = True  # its driver died: it never recorded its end
        self.manifest = Manifest(
            job=self.spec.name,
            status="running",
            fingerprint=self.fingerprint.to_json(),
            spec=spec_snapshot(self.spec),
            input_files=self.input_files,
            schema=self.schema,
            shards=[],
            shard_slots=self.plan.slots,
            runs=runs,
            budget=self.manifest.budget if self.manifest else None,
            duplicate_ids=self.manifest.duplicate_ids if self.manifest else None,
            fenced=self.fenced,
        )
        self.save(force=True)  # LeaseLost / ManifestConflict if another run took over
        self.out.delete(SUCCESS_NAME)  # the parts may change from here on
        return self.run

    # --- commit ------------------------------------------------------------------------------

    def on_part(self, event: PartWritten) -> None:
        """A part an engine actor wrote: commit it (in the next manifest save) or refuse it."""
        record = event.record
        if record.replaces is not None:
            decision = self.ledger.replace(record)
        else:
            decision = self.ledger.accept(record)
        if decision is not Decision.ACCEPTED:
            logger.warning("part %s refused (%s); it will be deleted", record.name, decision.value)
            self.refused.append(record.name)
            return
        if record.replaces is not None:
            self.refused.append(record.replaces)  # the replaced file goes once recorded
        self.rows_committed += record.generated_rows
        self.parts_committed += 1
        self.completion_tokens += record.sums.completion_tokens
        self.error_rows += record.sums.errors

    def save(self, force: bool = False) -> None:
        """Write the manifest if parts were committed since the last write and the commit
        interval has passed (or `force`)."""
        now = time.monotonic()
        if not force and (
            self.ledger.changes == 0 or now - self._last_save < self.spec.output.commit_interval_s
        ):
            return
        assert self.manifest is not None
        self._fill(self.manifest)
        self.lease.verify()  # LeaseLost if another run took the output over
        self.store.write(self.manifest)  # ManifestConflict if it did so just now
        self.ledger.mark_saved()
        self._last_save = now

    def _fill(self, manifest: Manifest) -> None:
        ledger = self.ledger
        manifest.shards = [s.to_json(ledger.parts) for s in ledger.shards]
        manifest.parts = [r.to_json() for r in ledger.records()]
        manifest.stats = ledger.stats.to_json()
        manifest.missing_rows = ledger.missing_rows()
        if self.run is not None:
            self.run.rows = self.rows_committed
            self.run.parts = self.parts_committed
            self.run.completion_tokens = self.completion_tokens
            self.run.error_rows = self.error_rows

    def parts_digest(self) -> str:
        """A digest of the committed parts' names: a check over them is still valid while it
        is the same."""
        import hashlib

        return hashlib.sha256("\n".join(sorted(self.ledger.parts)).encode()).hexdigest()[:16]

    def needs_duplicate_check(self) -> bool:
        """Whether the committed parts changed since the last cross-shard duplicate check."""
        done = (self.manifest.duplicate_ids if self.manifest else None) or {}
        return done.get("parts_digest") != self.parts_digest()

    # --- finish ------------------------------------------------------------------------------

    def finish(
        self,
        status: Status,
        wall_s: float,
        accounts: list[dict[str, Any]],
        events: list[dict[str, Any]],
        budget: dict[str, Any] | None,
        prune: Callable[[], None] | None = None,
    ) -> Manifest:
        """Record the run's end and the totals, delete what that record settles as garbage
        (then `prune()`: other files derived from parts no longer committed); `_SUCCESS`
        last, when complete."""
        assert self.manifest is not None and self.run is not None
        faults.pause_point("finish")  # tests: a driver that stalls here
        self.lease.verify()  # LeaseLost before anything changes if another run took over
        stale = self._stale_parts()
        self.run.wall_s = wall_s
        self.run.finished_at = utc_now()
        self.run.actors = accounts
        self.run.events = events
        if budget is not None:
            self.manifest.budget = budget
        for run in self.manifest.runs:  # runs that died: what their parts hold
            if run.interrupted:
                mine = [r for r in self.ledger.parts.values() if r.run == run.attempt]
                run.rows = sum(r.sums.rows for r in mine)
                run.parts = len(mine)
        self.manifest.status = status
        self._fill(self.manifest)
        if self.duplicate_ids is not None:  # the parts it checked, marked ones included
            self.manifest.duplicate_ids = {
                **self.duplicate_ids,
                "parts_digest": self.parts_digest(),
            }
        self.manifest.totals = compute_totals(self.ledger, self.manifest.runs, self.spec)
        self.lease.verify()
        self.store.write(self.manifest)  # ManifestConflict if another run wrote since
        # From here the stale parts are garbage by this run's own record: no run adopts them.
        for name in stale:
            self.out.delete(name)
        if prune is not None:
            prune()
        if status == "complete":
            self.out.put(SUCCESS_NAME, b"")  # last: marks the output complete
        return self.manifest

    def _stale_parts(self) -> list[str]:
        """Part files this run's record will not list: refused and replaced parts, leftovers
        of earlier runs. Never a part of a run numbered above this one (a run that took the
        output over)."""
        assert self.run is not None
        committed = set(self.ledger.parts)
        names = {*self.refused, *list_part_names(self.out)} - committed
        parsed = ((n, PartName.parse(n)) for n in sorted(names))
        return [n for n, part in parsed if part is not None and part.run <= self.run.attempt]


def settled_attempt(runs: list[RunRecord]) -> int:
    """The highest attempt that recorded its end (0: none): every part of it and of earlier
    runs that the manifest does not list is garbage."""
    return max((r.attempt for r in runs if r.finished_at is not None), default=0)


def compute_totals(ledger: CommitLedger, runs: list[RunRecord], spec: JobSpec) -> dict[str, Any]:
    """Totals over every committed row, from the part records and the merged stats (O(parts)),
    plus idle and load from every run's actor accounts."""

    sums = ledger.sums()
    stats = ledger.stats
    accounts = [ActorAccount.from_dict(a) for run in runs for a in run.actors]
    cost = job_totals(sums, accounts, spec.cost)
    wall_s = math.fsum(run.wall_s for run in runs)
    return {
        "rows": sums.rows,
        "rows_ok": sums.rows - sums.errors,
        "rows_error": sums.errors,
        "error_fraction": sums.errors / sums.rows if sums.rows else 0.0,
        "wall_s": wall_s,
        "output_tokens_per_s": cost.completion_tokens / wall_s if wall_s > 0 else None,
        # The throughput of task embed jobs, which have no output tokens.
        "prompt_tokens_per_s": cost.prompt_tokens / wall_s if wall_s > 0 else None,
        "latency_p50_s": stats.latency_s.quantile(0.5),
        "latency_p95_s": stats.latency_s.quantile(0.95),
        "ttft_p50_s": stats.ttft_s.quantile(0.5),
        "ttft_p95_s": stats.ttft_s.quantile(0.95),
        **cost.to_dict(),
        **_spec_totals(stats.spec, spec),
    }


def _spec_totals(counts: SpecCounts, spec: JobSpec) -> dict[str, Any]:
    """Speculative decoding totals, for jobs with engine.speculative only (see SpecCounts)."""
    if spec.engine.speculative is None:
        return {}
    return {
        "spec_proposed_tokens": counts.proposed,
        "spec_accepted_tokens": counts.accepted,
        "spec_verifications": counts.verifications,
        "spec_acceptance_rate": counts.acceptance_rate,
        "spec_accepted_per_verification": counts.accepted_per_verification,
    }
