"""The engines' test hooks are inert unless TOKENMILL_TEST_HOOKS=1."""

from __future__ import annotations

import pytest

from engines import faults


def test_off_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.HOOKS_ENV, raising=False)
    monkeypatch.setenv(faults.STEP_DELAY_ENV, "5")
    assert faults.step_delay_s() == 0.0
    assert faults.forwarded_env() == {}


def test_on_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    monkeypatch.setenv(faults.STEP_DELAY_ENV, "0.25")
    assert faults.step_delay_s() == 0.25
    assert faults.forwarded_env() == {
        faults.HOOKS_ENV: "1",
        faults.STEP_DELAY_ENV: "0.25",
    }
    monkeypatch.delenv(faults.STEP_DELAY_ENV)
    assert faults.step_delay_s() == 0.0
    assert faults.forwarded_env() == {faults.HOOKS_ENV: "1"}


def test_pause_and_exit_hooks_are_inert_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.HOOKS_ENV, raising=False)
    monkeypatch.setenv(faults.PAUSE_AT_ENV, "finish")
    monkeypatch.setenv(faults.PROMPT_EXIT_ENV, "POISON")
    faults.pause_point("finish")  # would stop this very process if it were on
    assert faults.prompt_exit_marker() is None
    assert faults.forwarded_env() == {}


def test_pause_and_exit_hooks_reach_the_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    monkeypatch.setenv(faults.PAUSE_AT_ENV, "finish")
    monkeypatch.setenv(faults.PROMPT_EXIT_ENV, "POISON")
    monkeypatch.delenv(faults.STEP_DELAY_ENV, raising=False)
    faults.pause_point("elsewhere")  # another point: goes on
    assert faults.prompt_exit_marker() == "POISON"
    assert faults.forwarded_env() == {
        faults.HOOKS_ENV: "1",
        faults.PAUSE_AT_ENV: "finish",
        faults.PROMPT_EXIT_ENV: "POISON",
    }


def test_the_processor_barrier_only_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.PROCESSOR_BARRIER_ENV, "2")
    monkeypatch.delenv(faults.HOOKS_ENV, raising=False)
    assert faults.processor_barrier() == 0
    monkeypatch.setenv(faults.HOOKS_ENV, "1")
    assert faults.processor_barrier() == 2
    assert faults.forwarded_env()[faults.PROCESSOR_BARRIER_ENV] == "2"
