"""Engine settings have one source: each engine's constructor. Its SETTINGS are derived from the
keyword parameters (engines.adapter.declared_settings), and the job spec's engine fields reach
an engine only where it declares them (pipeline.engine_setup.engine_settings)."""

from __future__ import annotations

import inspect

import pytest

from engines.factory import ENGINE_KINDS, accepted_settings
from pipeline.spec import EngineSpec

# EngineSpec fields that are not engine settings: the kind itself, the pass-through section and
# a planning figure (`tokenmill plan`).
SPEC_ONLY = {"kind", "extra", "expected_tokens_per_s"}


def _constructor(kind: str):
    if kind == "reference":
        from engines.reference.engine import ReferenceEngine

        return ReferenceEngine.__init__
    if kind == "trtllm":
        from engines.trtllm import TrtllmEngine

        return TrtllmEngine.__init__
    from engines.vllm import VllmEngine

    return VllmEngine.__init__


@pytest.mark.parametrize("kind", ["reference", "trtllm", "vllm"])
def test_settings_are_the_constructors_keyword_parameters(kind: str) -> None:
    params = inspect.signature(_constructor(kind)).parameters.values()
    named = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    settings = accepted_settings(kind)
    assert list(settings[: len(named)]) == named
    assert len(set(settings)) == len(settings)


def test_every_spec_engine_field_is_some_engines_setting() -> None:
    """A renamed constructor parameter fails here: engine_settings would drop the spec field
    it no longer matches without a word."""
    declared = set().union(*(accepted_settings(kind) for kind in ENGINE_KINDS))
    assert set(EngineSpec.model_fields) - SPEC_ONLY - declared == set()


def test_an_unknown_setting_names_it_and_the_accepted_ones() -> None:
    from engines.adapter import check_settings

    with pytest.raises(TypeError) as caught:
        check_settings("XEngine", ["b", "zz", "a"], ("a", "b"), also=" and more")
    assert str(caught.value) == "XEngine got unknown setting(s) zz; accepted: a, b and more"
    check_settings("XEngine", ["zz"], ("a",), also_allowed=["zz"])


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_the_shared_settings_table_is_what_each_kind_takes(kind: str) -> None:
    """engines/settings.py declares each shared setting once: the kinds that take it are the
    kinds whose constructor accepts it, and each constructor's default is the table's."""
    from engines.settings import SHARED, default

    accepted = set(accepted_settings(kind))
    for setting in SHARED:
        assert (setting.name in accepted) == (kind in setting.kinds), (kind, setting.name)
    if kind == "synthetic":
        from engines.synthetic.settings import DEFAULT_MAX_BATCH_SIZE

        assert default("synthetic", "max_batch_size") == DEFAULT_MAX_BATCH_SIZE
        return
    params = inspect.signature(_constructor(kind)).parameters
    for setting in SHARED:
        if kind in setting.kinds:
            assert params[setting.name].default == default(kind, setting.name), setting.name


def test_the_job_specs_defaults_come_from_the_table() -> None:
    """Where every kind shares a default the spec has it; where they differ the spec's null
    leaves each kind its own, and says which."""
    from engines.settings import SHARED, common_default

    spec = EngineSpec()
    for setting in SHARED:
        assert getattr(spec, setting.name) == common_default(setting.name), setting.name
    assert EngineSpec.model_fields["max_batch_size"].default is None
    assert "reference 64; trtllm 2048" in (
        EngineSpec.model_fields["max_batch_size"].description or ""
    )
