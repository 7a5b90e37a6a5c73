"""Building a checkpoint with the wrong ModelOpt fails up front, naming the version and where
to build instead (TensorRT-LLM 1.2's container carries ModelOpt 0.37; the build needs 0.47)."""

from __future__ import annotations

from importlib import metadata

import pytest

from engines.quantize.build import require_modelopt
from engines.quantize.config import QuantizeError


def _with_modelopt(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    real = metadata.version

    def version_of(name: str) -> str:
        if name == "nvidia-modelopt":
            if version is None:
                raise metadata.PackageNotFoundError(name)
            return version
        return real(name)

    monkeypatch.setattr(metadata, "version", version_of)


@pytest.mark.parametrize("found", ["0.37.0", None])
def test_an_other_modelopt_is_refused_with_the_fix(monkeypatch, found) -> None:
    _with_modelopt(monkeypatch, found)
    with pytest.raises(QuantizeError) as info:
        require_modelopt()
    message = str(info.value)
    assert f"this environment has {found or 'none'}" in message
    wanted = next(r for r in metadata.requires("tokenmill") if r.startswith("nvidia-modelopt"))
    assert wanted.split(";")[0].strip() in message and "tokenmill[quantize]" in message


def test_the_extras_modelopt_passes(monkeypatch) -> None:
    _with_modelopt(monkeypatch, "0.47.0")
    require_modelopt()
