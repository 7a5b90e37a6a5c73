"""The engines' test hooks are inert unless TOKENMILL_TEST_HOOKS=1."""

from __future__ import annotations

import pytest

from engines import testhooks


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
