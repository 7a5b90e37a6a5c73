"""Pure cost functions: step and interval splits, prices, job totals, estimates."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.api import StepRecord
from pipeline.cost import (
    ActorAccount,
    cost_usd,
    estimate_cost,
    job_totals,
    list_price_usd,
    row_cost,
    row_sums,
    split_intervals,
    split_steps,
)
from pipeline.spec import CostSpec, parse_job_spec

RIDS = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def sequential_steps(draw) -> list[StepRecord]:
    t = draw(st.floats(0, 100))
    steps = []
    for _ in range(draw(st.integers(0, 12))):
        t += draw(st.floats(0, 1))
        start = t
        t += draw(st.floats(0, 2))
        prefill = draw(st.dictionaries(RIDS, st.integers(0, 100), max_size=3))
        decode = draw(st.dictionaries(RIDS, st.integers(0, 3), max_size=3))
        steps.append(StepRecord(start, t, prefill, decode))
    return steps


@settings(max_examples=200, deadline=None)
@given(
    steps=sequential_steps(),
    pw=st.floats(0, 5),
    dw=st.floats(0.01, 5),
)
def test_split_steps_shares_every_nonempty_step_exactly(steps, pw, dw):
    shares = split_steps(steps, pw, dw)
    assert all(v >= 0 and math.isfinite(v) for v in shares.values())
    busy = math.fsum(s.end - s.start for s in steps if s.request_ids)
    assert math.fsum(shares.values()) == pytest.approx(busy, rel=1e-9, abs=1e-12)
    assert set(shares) <= set().union(*(s.request_ids for s in steps)) if steps else not shares


def test_split_steps_weights_and_gaps():
    steps = [
        StepRecord(1.0, 2.0, {"a": 30}, {"b": 1}),  # pw 1, dw 10: a 30/40, b 10/40
        StepRecord(2.5, 3.0, {}, {"b": 1}),  # the gap 2.0-2.5 goes to b too (arrivals given)
    ]
    shares = split_steps(steps, 1.0, 10.0)
    assert shares == pytest.approx({"a": 0.75, "b": 0.25 + 0.5})
    with_gaps = split_steps(steps, 1.0, 10.0, arrivals={"a": 0.0, "b": 0.5}, start=0.2)
    # Gap before step 1 runs from max(start 0.2, earliest arrival 0.0) = 0.2: 0.8 s, shared 3:1.
    assert with_gaps == pytest.approx({"a": 1.8 * 0.75, "b": 1.8 * 0.25 + 1.0})


def test_split_steps_zero_weights_share_equally_and_empty_steps_are_idle():
    steps = [StepRecord(0.0, 1.0, {"a": 5, "b": 9}, {}), StepRecord(1.0, 2.0, {}, {})]
    assert split_steps(steps, 0.0, 1.0) == pytest.approx({"a": 0.5, "b": 0.5})


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text("abcdef", min_size=1, max_size=3),
        st.tuples(st.floats(0, 50), st.floats(0, 20)),
        max_size=8,
    )
)
def test_split_intervals_covers_the_union_of_busy_time(raw):
    intervals = {rid: (s, s + d) for rid, (s, d) in raw.items()}
    shares = split_intervals(intervals)
    assert all(v >= 0 and math.isfinite(v) for v in shares.values())
    # Union length of the intervals, computed independently.
    union, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals.values()):
        if cur_e is None or s > cur_e:
            union += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    union += 0.0 if cur_e is None else cur_e - cur_s
    assert math.fsum(shares.values()) == pytest.approx(union, rel=1e-9, abs=1e-9)
    for rid, (s, e) in intervals.items():
        assert shares[rid] <= e - s + 1e-9


def test_split_intervals_alone_and_identical():
    assert split_intervals({"a": (1.0, 4.0)}) == {"a": 3.0}
    shares = split_intervals({"a": (0.0, 2.0), "b": (0.0, 2.0), "c": (1.0, 3.0)})
    assert shares["a"] == pytest.approx(shares["b"])
    assert shares == pytest.approx({"a": 0.5 + 1 / 3, "b": 0.5 + 1 / 3, "c": 1 / 3 + 1})


def test_prices():
    spec = CostSpec(
        device_hour_usd=3.5,
        price_per_million={"input": 2.0, "cached_input": 0.5, "output": 8.0},
        batch_discount=0.5,
    )
    assert cost_usd(3600, spec) == pytest.approx(3.5)
    # 1000 uncached x $2 + 500 cached x $0.5 + 100 out x $8, per 1M, half price.
    assert list_price_usd(1500, 500, 100, spec) == pytest.approx(
        (1000 * 2 + 500 * 0.5 + 100 * 8) / 1e6 * 0.5
    )
    no_cached_price = CostSpec(price_per_million={"input": 2.0, "output": 8.0})
    assert list_price_usd(1500, 500, 0, no_cached_price) == pytest.approx(1500 * 2 / 1e6)
    assert list_price_usd(10, 0, 10, CostSpec()) == 0.0
    row = row_cost(7.2, 1500, 500, 100, spec)
    assert row.cost_usd == pytest.approx(7.2 * 3.5 / 3600)


def test_job_totals_include_idle_and_load_and_compare_with_list_prices():
    spec = CostSpec(device_hour_usd=3.6, price_per_million={"input": 1.0, "output": 10.0})
    rows = pa.table(
        {
            "prompt_tokens": [100, 300],
            "cached_prompt_tokens": [0, 100],
            "completion_tokens": [50, 50],
            "gpu_seconds": [30.0, 50.0],
            "cost_usd": [0.03, 0.05],
            "list_price_usd": [0.0006, 0.0008],
        }
    )
    accounts = [
        ActorAccount(
            devices=2,
            lifetime_s=60,
            load_s=20,
            idle_s=20,
            attributed_s=80,
            pending_s=0,
            num_rows=2,
        )
    ]
    totals = job_totals(row_sums(rows), accounts, spec)
    assert totals.device_hours == pytest.approx(120 / 3600)
    assert totals.total_usd == pytest.approx(0.12)
    assert totals.rows_usd == pytest.approx(0.08)
    assert totals.idle_usd == pytest.approx(0.02)
    assert totals.load_usd == pytest.approx(0.02)
    assert totals.busy_fraction == pytest.approx(80 / 120)
    assert totals.usd_per_million_output == pytest.approx(0.12 / 100 * 1e6)
    assert totals.usd_per_million_input == pytest.approx(0.12 / 400 * 1e6)
    assert totals.output_tokens_per_s_per_device == pytest.approx(100 / 120)
    assert totals.list_price_usd == pytest.approx(0.0014)
    assert totals.list_price_ratio == pytest.approx(0.12 / 0.0014)
    assert job_totals(row_sums(rows), accounts, CostSpec()).list_price_usd is None


def _job(**cost) -> dict:
    return {
        "name": "t",
        "input": {"uri": "in.parquet", "prompt_column": "p"},
        "model": {"path": "m"},
        "output": {"uri": "out"},
        "resources": {"num_actors": 2, "devices_per_actor": 1},
        "cost": cost,
    }


def test_estimate_matches_the_documented_example():
    # One H200 at $3.50/h producing 3,000 output tok/s: about $0.32 per 1M output tokens.
    spec = parse_job_spec(_job(device_hour_usd=3.5, price_per_million={"output": 1.0}))
    est = estimate_cost(
        spec, num_rows=1000, prompt_tokens=0, output_tokens=6_000_000, tokens_per_s=3000
    )
    assert est.wall_s == pytest.approx(1000.0)  # 2 actors x 3000 tok/s
    assert est.device_hours == pytest.approx(2 * 1000 / 3600)
    assert est.usd_per_million_output == pytest.approx(3.5 / (3000 * 3600) * 1e6)
    assert round(est.usd_per_million_output, 2) == 0.32
    assert est.list_price_usd == pytest.approx(6.0)
    with pytest.raises(ValueError, match="tokens_per_s"):
        estimate_cost(spec, 1, 1, 1, 0.0)


@settings(max_examples=150, deadline=None)
@given(steps=sequential_steps(), pw=st.floats(0, 5), dw=st.floats(0.01, 5))
def test_identical_requests_get_equal_shares(steps, pw, dw):
    """A twin that processes exactly what "a" processes, in the same steps, pays the same."""
    twinned = [
        StepRecord(
            s.start,
            s.end,
            {
                **s.prefill_tokens,
                **({"twin": s.prefill_tokens["a"]} if "a" in s.prefill_tokens else {}),
            },
            {
                **s.decode_tokens,
                **({"twin": s.decode_tokens["a"]} if "a" in s.decode_tokens else {}),
            },
        )
        for s in steps
    ]
    arrivals = dict.fromkeys(["a", "b", "c", "d", "twin"], 0.0)
    shares = split_steps(twinned, pw, dw, arrivals=arrivals, start=0.0)
    assert shares.get("twin", 0.0) == pytest.approx(shares.get("a", 0.0), rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(steps=sequential_steps(), arrival=st.floats(0, 100), pw=st.floats(0, 5))
def test_a_request_alone_gets_all_engine_time_from_its_arrival(steps, arrival, pw):
    alone = [StepRecord(s.start, s.end, {"a": 3}, {"a": 1}) for s in steps if s.start >= arrival]
    shares = split_steps(alone, pw, 1.0, arrivals={"a": arrival}, start=arrival)
    expected = alone[-1].end - arrival if alone else 0.0
    assert shares.get("a", 0.0) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert split_intervals({"a": (arrival, arrival + 2.5)}) == {"a": pytest.approx(2.5)}
