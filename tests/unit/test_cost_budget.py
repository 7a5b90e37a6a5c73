"""BudgetGate: the admission rule, its projection rate and the closed-stays-closed stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batch.driver.budget import BudgetGate, prior_from_totals
from pipeline.batch.units import RowAdmission, RowSpend


def _rows(n: int, prompt: int = 10, max_tokens: int = 10, prefix: str = "r"):
    return [RowAdmission(f"{prefix}{i}", prompt, max_tokens) for i in range(n)]


def test_projection_uses_finished_rows_and_the_gate_stays_closed():
    gate = BudgetGate(budget_usd=1.0)
    # No rate yet: the first wave is admitted on spend alone.
    assert gate.admit(_rows(2)) == [True, True]
    gate.finish([RowSpend("r0", cost_usd=0.2, tokens=20), RowSpend("r1", cost_usd=0.2, tokens=20)])
    assert gate.usd_per_token == pytest.approx(0.01)
    # spent 0.4; each new row projects 0.01 x 20 = 0.2 → three fit (1.0), the fourth does not.
    assert gate.admit(_rows(4, prefix="s")) == [True, True, True, False]
    state = gate.state()
    assert state.is_closed and state.num_refused == 1 and state.num_admitted == 5
    assert state.in_flight_usd == pytest.approx(0.6)
    # Closed stays closed, even for a row that would fit once in-flight rows finish.
    gate.finish([RowSpend(f"s{i}", cost_usd=0.01, tokens=1) for i in range(3)])
    assert gate.admit([RowAdmission("tiny", 0, 1)]) == [False]


def test_spend_counts_actor_time_and_earlier_runs():
    gate = BudgetGate(budget_usd=2.0, spent_before_usd=0.5, prior_usd_per_token=0.001)
    gate.report_spend("a", 0.3)
    gate.report_spend("b", 0.4)
    gate.report_spend("a", 0.1)  # stale report: spend only grows
    assert gate.spent_usd == pytest.approx(0.5 + 0.7)
    # The prior rate projects before any row has finished: 0.001 x 500 = 0.5 per row.
    assert gate.admit(_rows(2, prompt=100, max_tokens=400)) == [True, False]
    gate.finish([RowSpend("r0", cost_usd=2.0, tokens=10)])  # rows beyond actor reports
    assert gate.spent_usd == pytest.approx(0.5 + 2.0)


def test_prior_from_manifest_totals_and_bad_budget():
    assert prior_from_totals(
        {"total_usd": 1.5, "rows_usd": 1.0, "prompt_tokens": 600, "completion_tokens": 400}
    ) == (1.5, pytest.approx(0.001))
    assert prior_from_totals({}) == (0.0, None)
    with pytest.raises(ValueError, match=r"cost\.budget_usd"):
        BudgetGate(budget_usd=0.0)


@settings(max_examples=150, deadline=None)
@given(
    budget=st.floats(0.01, 10.0),
    rate=st.floats(1e-5, 1e-2),
    rows=st.lists(
        st.tuples(st.integers(1, 200), st.integers(1, 200), st.floats(0.0, 1.0)), max_size=60
    ),
    wave=st.integers(1, 8),
)
def test_spend_never_passes_the_budget_when_the_rate_holds(budget, rate, rows, wave):
    """With a known rate and rows that use at most prompt + max_tokens, admitted rows' real
    cost stays within budget, and the gate only refuses a row that would not have fit."""
    gate = BudgetGate(budget_usd=budget, prior_usd_per_token=rate)
    spent = 0.0
    for start in range(0, len(rows), wave):
        chunk = rows[start : start + wave]
        asks = [RowAdmission(f"r{start + i}", p, m) for i, (p, m, _) in enumerate(chunk)]
        decisions = gate.admit(asks)
        assert decisions == sorted(decisions, reverse=True)  # a prefix is admitted
        done = []
        for ask, ok, (p, m, used) in zip(asks, decisions, chunk, strict=True):
            if ok:
                tokens = p + round(m * used)
                done.append(RowSpend(ask.row_id, rate * tokens, tokens))
                spent += rate * tokens
        gate.finish(done)
        assert spent <= budget * (1 + 1e-9)
        if not all(decisions):
            assert gate.state().is_closed


def _spec(**engine):
    from pipeline.spec import parse_job_spec

    return parse_job_spec(
        {
            "name": "b",
            "input": {"uri": "x.jsonl", "format": "jsonl", "prompt_column": "p"},
            "model": {"path": "m"},
            "engine": engine,
            "resources": {"devices_per_actor": 2},
            "output": {"uri": "out"},
            "cost": {"device_hour_usd": 3.6, "budget_usd": 5.0},
        }
    )


def test_gate_for_job_priors():
    from pipeline.batch.driver.budget import gate_for_job

    # Two GPUs at $3.60/h = $0.002/s per actor; 100 output tok/s → $0.00002 per token.
    gate = gate_for_job(_spec(expected_tokens_per_s=100.0), None)
    assert gate.budget_usd == 5.0 and gate.spent_before_usd == 0.0
    assert gate.usd_per_token == pytest.approx(0.002 / 100)
    # An earlier run's totals win over the throughput prior.
    totals = {"total_usd": 1.0, "rows_usd": 0.5, "prompt_tokens": 400, "completion_tokens": 100}
    gate = gate_for_job(_spec(expected_tokens_per_s=100.0), totals)
    assert gate.spent_before_usd == 1.0 and gate.usd_per_token == pytest.approx(0.001)
    assert gate_for_job(_spec(), None).usd_per_token is None
