"""The engine occupancy books (pipeline.batch.driver.occupancy): actor-seconds up, idle, and idle at
the tail, integrated from state changes."""

from __future__ import annotations

import pytest

from pipeline.batch.driver.occupancy import BUSY, DOWN, IDLE, Occupancy


def test_two_actors_one_runs_dry_at_the_tail() -> None:
    books = Occupancy()
    books.changed(0.0, DOWN, IDLE)  # both up before any work: start-up is not counted
    books.changed(1.0, DOWN, IDLE)
    books.handed_out(10.0, whole_shard=True)
    books.changed(10.0, IDLE, BUSY)
    books.handed_out(10.0, whole_shard=True)  # the last whole shard: the tail starts here
    books.changed(10.0, IDLE, BUSY)
    books.changed(14.0, BUSY, IDLE)  # actor A runs dry, B goes on until 20
    got = books.to_json(20.0)
    assert got["engine_actor_s"] == pytest.approx(20.0)  # 2 actors x 10 s
    assert got["idle_actor_s"] == pytest.approx(6.0)
    assert got["tail_s"] == pytest.approx(10.0)
    assert got["tail_idle_actor_s"] == pytest.approx(6.0)
    assert got["tail_idle_fraction"] == pytest.approx(0.3)


def test_a_split_piece_keeps_the_tail_and_fills_the_idle_actor() -> None:
    books = Occupancy()
    books.changed(0.0, DOWN, IDLE)
    books.changed(0.0, DOWN, IDLE)
    for _ in range(2):
        books.handed_out(0.0, whole_shard=True)
        books.changed(0.0, IDLE, BUSY)
    books.changed(4.0, BUSY, IDLE)
    books.handed_out(5.0, whole_shard=False)  # rows split off to the dry actor
    books.changed(5.0, IDLE, BUSY)
    books.changed(12.0, BUSY, IDLE)
    got = books.to_json(12.0)
    assert got["tail_s"] == pytest.approx(12.0)  # a piece does not restart the tail
    assert got["tail_idle_actor_s"] == pytest.approx(1.0)
    assert got["idle_actor_s"] == pytest.approx(1.0)


def test_a_lost_actor_is_not_counted_while_down_and_a_requeued_shard_moves_the_tail() -> None:
    books = Occupancy()
    books.changed(0.0, DOWN, IDLE)
    books.handed_out(0.0, whole_shard=True)
    books.changed(0.0, IDLE, BUSY)
    books.changed(2.0, BUSY, DOWN)  # lost with its unit
    books.changed(5.0, DOWN, IDLE)  # restarted
    books.handed_out(6.0, whole_shard=True)  # its shard again, whole
    books.changed(6.0, IDLE, BUSY)
    books.changed(9.0, BUSY, IDLE)
    got = books.to_json(9.0)
    assert got["engine_actor_s"] == pytest.approx(6.0)  # 0-2 and 5-9
    assert got["idle_actor_s"] == pytest.approx(1.0)
    assert got["tail_s"] == pytest.approx(3.0) and got["tail_idle_actor_s"] == 0.0
