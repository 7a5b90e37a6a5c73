"""The job budget (`cost.budget_usd`): stop admitting rows before spend would pass it.

Rule: a row is admitted only if

    spent + projected cost of the rows in flight + projected cost of this row <= budget

* spent: what earlier runs on this output cost (from the manifest) plus, for this run, the
  larger of (a) the actors' paid time so far (devices x lifetime x price, reported by the
  actors, so idle and load count) and (b) the sum of finished rows' cost_usd. Both are lower
  bounds of the true spend; (a) is usually the larger one.
* projected cost of a row: usd_per_token x (prompt_tokens + max_tokens), where usd_per_token is
  the cost per processed token of the rows finished so far (this run's rows; before the first
  one finishes, the prior rate given at start: the previous run's rate, or one derived from
  engine.expected_tokens_per_s).
  max_tokens is an upper bound on the completion, so the projection errs on the safe side.
  With no rate at all (a first run, nothing finished yet) a row is projected at 0: the first
  wave of rows (up to max_in_flight per actor) is admitted on spend alone. docs/cost-accounting.md
  explains the resulting overshoot bound.
* Once a row is refused the gate stays closed: later (smaller) rows are refused too, so the
  run stops cleanly and a rerun with a higher budget resumes exactly the rows not committed.

`BudgetGate` is plain Python (unit-tested without Ray); `start_budget_actor` hosts one gate in
a small Ray actor shared by every engine actor of a run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.cost import billed_devices

if TYPE_CHECKING:
    from pipeline.spec import JobSpec
from pipeline.batch.units import RowAdmission, RowSpend


@dataclass(frozen=True)
class BudgetState:
    """A snapshot of the gate, for logs, the manifest and tests."""

    budget_usd: float
    spent_usd: float  # earlier runs + this run so far
    in_flight_usd: float  # projected cost of admitted rows not finished
    usd_per_token: float | None  # the projection rate in use
    num_admitted: int
    num_refused: int
    is_closed: bool  # a row was refused: no more rows are admitted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BudgetGate:
    """Admission control for one job's budget; see the module docstring for the rule."""

    budget_usd: float
    spent_before_usd: float = 0.0  # cost of earlier runs on the same output
    prior_usd_per_token: float | None = None  # projection rate until this run has a row done
    _actor_spend: dict[str, float] = field(default_factory=dict)  # actor -> paid USD so far
    _in_flight: dict[str, float] = field(default_factory=dict)  # row id -> projected USD
    _rows_usd: float = 0.0  # finished rows of this run
    _rows_tokens: int = 0
    _num_admitted: int = 0
    _num_refused: int = 0
    _closed: bool = False

    def __post_init__(self) -> None:
        if not self.budget_usd > 0:
            raise ValueError(f"cost.budget_usd must be > 0, got {self.budget_usd!r}")

    # -- rates and totals --------------------------------------------------------------------

    @property
    def usd_per_token(self) -> float | None:
        if self._rows_tokens > 0:
            return self._rows_usd / self._rows_tokens
        return self.prior_usd_per_token

    @property
    def spent_usd(self) -> float:
        this_run = max(sum(self._actor_spend.values()), self._rows_usd)
        return self.spent_before_usd + this_run

    @property
    def in_flight_usd(self) -> float:
        return sum(self._in_flight.values())

    def projected_usd(self, row: RowAdmission) -> float:
        rate = self.usd_per_token
        if rate is None:
            return 0.0
        return rate * (max(row.prompt_tokens, 0) + max(row.max_tokens, 0))

    # -- admission ---------------------------------------------------------------------------

    def admit(self, rows: list[RowAdmission]) -> list[bool]:
        """Admit rows in order until one would pass the budget; that one and all later rows
        (now and in later calls) are refused."""
        decisions = []
        committed = self.spent_usd + self.in_flight_usd
        for row in rows:
            if not self._closed:
                projected = self.projected_usd(row)
                if committed + projected <= self.budget_usd:
                    self._in_flight[row.row_id] = projected
                    committed += projected
                    self._num_admitted += 1
                    decisions.append(True)
                    continue
                self._closed = True
            self._num_refused += 1
            decisions.append(False)
        return decisions

    def finish(self, rows: list[RowSpend]) -> None:
        """Admitted rows left the engine: their projection becomes their real cost."""
        for row in rows:
            self._in_flight.pop(row.row_id, None)
            self._rows_usd += max(row.cost_usd, 0.0)
            self._rows_tokens += max(row.tokens, 0)

    def report_spend(self, actor_id: str, paid_usd: float) -> None:
        """An actor's paid time so far, in USD (devices x lifetime x price); only grows."""
        self._actor_spend[actor_id] = max(self._actor_spend.get(actor_id, 0.0), paid_usd)

    def state(self) -> BudgetState:
        return BudgetState(
            budget_usd=self.budget_usd,
            spent_usd=self.spent_usd,
            in_flight_usd=self.in_flight_usd,
            usd_per_token=self.usd_per_token,
            num_admitted=self._num_admitted,
            num_refused=self._num_refused,
            is_closed=self._closed,
        )


def prior_from_totals(totals: dict[str, Any]) -> tuple[float, float | None]:
    """(spent_before_usd, usd_per_token) from an earlier run's manifest totals."""
    spent = float(totals.get("total_usd") or 0.0)
    rows_usd = float(totals.get("rows_usd") or 0.0)
    tokens = int(totals.get("prompt_tokens") or 0) + int(totals.get("completion_tokens") or 0)
    return spent, (rows_usd / tokens if tokens > 0 and rows_usd > 0 else None)


def prior_from_expected_throughput(spec: JobSpec) -> float | None:
    """USD per token from `engine.expected_tokens_per_s` (output tokens/s per actor), or None.

    It prices every token like an output token, which over-projects prompt tokens: a safe
    prior for the first wave, replaced as soon as this run's first rows finish.
    """
    expected = spec.engine.expected_tokens_per_s
    if not expected or expected <= 0:
        return None
    usd_per_actor_s = billed_devices(spec.resources.devices_per_actor) * (
        spec.cost.device_hour_usd / 3600.0
    )
    return usd_per_actor_s / expected


def gate_for_job(spec: JobSpec, previous_totals: dict[str, Any] | None) -> BudgetGate:
    """The gate for a run: earlier spend and rate from the previous manifest's totals, else a
    prior rate from engine.expected_tokens_per_s (else none: see the first-wave rule)."""
    if spec.cost.budget_usd is None:
        raise ValueError("cost.budget_usd is not set: there is no budget to enforce")
    spent, rate = prior_from_totals(previous_totals or {})
    if rate is None:
        rate = prior_from_expected_throughput(spec)
    return BudgetGate(spec.cost.budget_usd, spent, rate)


def start_budget_actor(gate: BudgetGate) -> Any:
    """A Ray actor holding `gate`, shared by the run's engine actors (0 CPUs: it only counts).

    Its methods are BudgetGate's: `admit.remote(rows)`, `finish.remote(rows)`,
    `report_spend.remote(actor_id, usd)`, `state.remote()`.
    """
    import ray

    remote_gate = ray.remote(num_cpus=0, max_restarts=0)(BudgetGate)
    return remote_gate.remote(gate.budget_usd, gate.spent_before_usd, gate.prior_usd_per_token)
