"""The engines' test hooks are inert unless TOKENMILL_TEST_HOOKS=1."""

from __future__ import annotations

import pytest

from engines.dev import testhooks


def test_off_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(testhooks.HOOKS_ENV, raising=False)
    monkeypatch.setenv(testhooks.STEP_DELAY_ENV, "5")
    assert testhooks.step_delay_s() == 0.0
    assert testhooks.forwarded_env() == {}


def test_on_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testhooks.HOOKS_ENV, "1")
    monkeypatch.setenv(testhooks.STEP_DELAY_ENV, "0.25")
    assert testhooks.step_delay_s() == 0.25
    assert testhooks.forwarded_env() == {
        testhooks.HOOKS_ENV: "1",
        testhooks.STEP_DELAY_ENV: "0.25",
    }
    monkeypatch.delenv(testhooks.STEP_DELAY_ENV)
    assert testhooks.step_delay_s() == 0.0
    assert testhooks.forwarded_env() == {testhooks.HOOKS_ENV: "1"}


def test_pause_and_exit_hooks_are_inert_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(testhooks.HOOKS_ENV, raising=False)
    monkeypatch.setenv(testhooks.PAUSE_AT_ENV, "finish")
    monkeypatch.setenv(testhooks.PROMPT_EXIT_ENV, "POISON")
    testhooks.pause_point("finish")  # would stop this very process if it were on
    assert testhooks.prompt_exit_marker() is None
    assert testhooks.forwarded_env() == {}


def test_pause_and_exit_hooks_reach_the_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testhooks.HOOKS_ENV, "1")
    monkeypatch.setenv(testhooks.PAUSE_AT_ENV, "finish")
    monkeypatch.setenv(testhooks.PROMPT_EXIT_ENV, "POISON")
    monkeypatch.delenv(testhooks.STEP_DELAY_ENV, raising=False)
    testhooks.pause_point("elsewhere")  # another point: goes on
    assert testhooks.prompt_exit_marker() == "POISON"
    assert testhooks.forwarded_env() == {
        testhooks.HOOKS_ENV: "1",
        testhooks.PAUSE_AT_ENV: "finish",
        testhooks.PROMPT_EXIT_ENV: "POISON",
    }


def test_the_processor_barrier_only_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testhooks.PROCESSOR_BARRIER_ENV, "2")
    monkeypatch.delenv(testhooks.HOOKS_ENV, raising=False)
    assert testhooks.processor_barrier() == 0
    monkeypatch.setenv(testhooks.HOOKS_ENV, "1")
    assert testhooks.processor_barrier() == 2
    assert testhooks.forwarded_env()[testhooks.PROCESSOR_BARRIER_ENV] == "2"
