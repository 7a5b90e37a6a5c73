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

    from pipeline.serve.access.auth import AuthConfigError
    from pipeline.serve.app import app_builder

    config = str(Path(__file__).resolve().parents[2] / "jobs" / "serve.yaml")
    monkeypatch.setenv("TOKENMILL_API_KEYS", "")
    with pytest.raises(AuthConfigError, match="TOKENMILL_API_KEYS"):
        app_builder({"config": config})
    assert isinstance(app_builder({"config": config, "insecure_no_auth": "true"}), Application)
    monkeypatch.setenv("TOKENMILL_API_KEYS", "k1")
    assert isinstance(app_builder({"config": config}), Application)


def test_rayservice_probe_builders_make_the_probe_apps() -> None:
    """serveConfigV2's /ready and /health applications (infra/terraform/workloads)."""
    from ray.serve import Application

    from pipeline.serve.http.probes import health_app_builder, ready_app_builder, ready_probe_args

    config = str(Path(__file__).resolve().parents[2] / "jobs" / "serve.yaml")
    assert isinstance(ready_app_builder({"config": config, "app": "tokenmill"}), Application)
    assert isinstance(health_app_builder({}), Application)
    # Which app /ready watches (the file's name unless told), and the deployment holding
    # each model's engine (one model: the ingress, http.one_hop).
    assert ready_probe_args({"config": config, "app": "prod"}) == (
        "prod",
        {"tiny-llama": "OpenAIIngress"},
    )
    assert ready_probe_args({"config": config})[0] == "tokenmill"


def test_a_broken_keys_file_is_named_before_ray_starts(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "team-a", "sha256": "sk-" + "b" * 20}]}))
    data = {**MINIMAL, "auth": {"keys_file": str(keys)}}
    result = run_cli("serve", str(write(tmp_path, data)), env=no_keys_env())
    assert result.returncode == 2
    assert str(keys) in result.stderr and "keys[0] (name 'team-a').sha256" in result.stderr
    assert "sk-" + "b" * 20 not in result.stderr  # never quoted: it may be a key
    assert "Started a local Ray" not in result.stderr


def test_key_digest_reads_stdin_and_never_prints_the_key() -> None:
    import hashlib
    import subprocess
    import sys

    from tests.e2e.serve_fixtures import REPO

    key = "sk-test-0123456789"
    cmd = [str(Path(sys.executable).parent / "tokenmill"), "key-digest", "--name", "team-a"]
    result = subprocess.run(cmd, input=key + "\n", capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert key not in result.stdout + result.stderr
    entry = yaml.safe_load("keys:\n" + result.stdout)["keys"][0]
    assert entry == {"name": "team-a", "sha256": hashlib.sha256(key.encode()).hexdigest()}
