"""`tokenmill serve` refuses to start on configurations it must not serve, before Ray starts.

Each case runs the real CLI and must fail fast (no Ray, no model load) with exit code 2 and
a message naming what to fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.serve_fixtures import run_cli

MINIMAL = {"models": [{"name": "m", "model": {"path": "/nonexistent/model"}}]}


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def no_keys_env() -> dict[str, str]:
    return {"TOKENMILL_API_KEYS": "", "OTHER_KEYS": ""}


def test_no_api_key_refuses_to_start(tmp_path: Path) -> None:
    result = run_cli("serve", str(write(tmp_path, MINIMAL)), env=no_keys_env())
    assert result.returncode == 2
    assert "TOKENMILL_API_KEYS" in result.stderr and "--insecure-no-auth" in result.stderr
    assert "Started a local Ray" not in result.stderr


def test_named_key_variable_and_missing_secrets_file(tmp_path: Path) -> None:
    data = {**MINIMAL, "auth": {"api_keys_env": "OTHER_KEYS"}}
    result = run_cli("serve", str(write(tmp_path, data)), env=no_keys_env())
    assert result.returncode == 2 and "OTHER_KEYS" in result.stderr

    missing = tmp_path / "no-such-keys.txt"
    data = {**MINIMAL, "auth": {"api_keys_file": str(missing)}}
    result = run_cli("serve", str(write(tmp_path, data)), env=no_keys_env())
    assert result.returncode == 2 and str(missing) in result.stderr


@pytest.mark.parametrize(
    ("field_path", "data"),
    [
        ("api_key", {**MINIMAL, "api_key": "abc"}),
        ("auth.api_keys", {**MINIMAL, "auth": {"api_keys": ["abc"]}}),
        (
            "models[0].model.name",
            {"models": [{"name": "m", "model": {"path": "/x", "name": "sk-" + "a" * 20}}]},
        ),
    ],
    ids=["top-level", "auth", "by-value"],
)
def test_keys_in_the_yaml_are_rejected(tmp_path: Path, field_path: str, data: dict) -> None:
    result = run_cli("serve", str(write(tmp_path, data)), env={"TOKENMILL_API_KEYS": "k"})
    assert result.returncode == 2
    assert field_path in result.stderr and "never go in the serve file" in result.stderr


def test_unknown_field_names_its_path(tmp_path: Path) -> None:
    data = {"models": [{"name": "m", "model": {"path": "/x"}, "replicas": {"max_replica": 2}}]}
    result = run_cli("serve", str(write(tmp_path, data)), env={"TOKENMILL_API_KEYS": "k"})
    assert result.returncode == 2
    assert "models.0.replicas.max_replica" in result.stderr and "unknown field" in result.stderr


def test_missing_local_model_is_named_before_ray_starts(tmp_path: Path) -> None:
    result = run_cli("serve", str(write(tmp_path, MINIMAL)), env={"TOKENMILL_API_KEYS": "k"})
    assert result.returncode == 2
    assert "/nonexistent/model" in result.stderr and "--make-demo-model" in result.stderr
    assert "Started a local Ray" not in result.stderr


def test_rayservice_builder_makes_the_same_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """KubeRay's serveConfigV2 runs `pipeline.serve.app:app_builder` with `config` in args."""
    from ray.serve import Application

    from pipeline.serve.app import app_builder
    from pipeline.serve.auth import AuthConfigError

    config = str(Path(__file__).resolve().parents[2] / "jobs" / "serve.yaml")
    monkeypatch.setenv("TOKENMILL_API_KEYS", "")
    with pytest.raises(AuthConfigError, match="TOKENMILL_API_KEYS"):
        app_builder({"config": config})
    assert isinstance(app_builder({"config": config, "insecure_no_auth": "true"}), Application)
    monkeypatch.setenv("TOKENMILL_API_KEYS", "k1")
    assert isinstance(app_builder({"config": config}), Application)
