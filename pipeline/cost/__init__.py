"""Per-token cost accounting: engine time → per-row device-seconds, USD and list prices.

- `prices`: device-seconds → USD, tokens → list-price USD, a row's cost columns;
- `meter`: the split of an actor's engine time among its rows: `CostMeter`, incremental,
  inside an engine actor, with the actor's `ActorAccount`; `split_steps` / `split_intervals`,
  the same rules as pure functions (the model and its invariant are in its docstring);
- `totals`: the sums of rows and a job's cost figures;
- `estimate`: pre-flight estimates (`tokenmill plan`).

docs/cost-accounting.md has the formulas and a worked example.
"""

from pipeline.cost.estimate import CostEstimate, estimate_cost, estimate_for_resources
from pipeline.cost.meter import ActorAccount, CostMeter, split_intervals, split_steps
from pipeline.cost.prices import (
    SECONDS_PER_HOUR,
    TOKENS_PER_MILLION,
    RowCost,
    billed_devices,
    cost_usd,
    list_price_usd,
    row_cost,
)
from pipeline.cost.totals import SUM_FIELDS, CostTotals, RowSums, job_totals, row_sums

__all__ = [
    "SECONDS_PER_HOUR",
    "SUM_FIELDS",
    "TOKENS_PER_MILLION",
    "ActorAccount",
    "CostEstimate",
    "CostMeter",
    "CostTotals",
    "RowCost",
    "RowSums",
    "billed_devices",
    "cost_usd",
    "estimate_cost",
    "estimate_for_resources",
    "job_totals",
    "list_price_usd",
    "row_cost",
    "row_sums",
    "split_intervals",
    "split_steps",
]
