"""infra/terraform checked offline: no provider can be downloaded here, so `terraform validate`
is impossible. Instead every .tf file is parsed with python-hcl2 and the wiring that matters is
asserted on the parsed tree; checkov runs as a static analyser when it is installed."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from pipeline.serve.spec import load_serve_spec
from pipeline.spec import load_job_spec
from pipeline.submit import NIGHTLY_DATE_EXPR, nightly_submit_argv, nightly_submit_shell

REPO = Path(__file__).resolve().parents[2]
TF_ROOT = REPO / "infra" / "terraform"
MODULES = ("cluster", "workloads")
TF_FILES = sorted(TF_ROOT.rglob("*.tf"))


# --- parsing helpers -------------------------------------------------------------------------


def clean(node: Any) -> Any:
    """python-hcl2 keeps literal strings quoted (`'"Forbid"'`) and expressions bare
    (`'${var.x}'`); unquote literals and drop parser bookkeeping keys."""
    if isinstance(node, dict):
        return {
            clean(k): clean(v) for k, v in node.items() if k not in ("__is_block__", "__comments__")
        }
    if isinstance(node, list):
        return [clean(v) for v in node]
    if isinstance(node, str) and len(node) >= 2 and node[0] == node[-1] == '"':
        return json.loads(node)
    return node


def load_module(name: str) -> dict[str, Any]:
    """All blocks of one root module: resources by (type, name), locals, variables, outputs."""
    module: dict[str, Any] = {"resource": {}, "locals": {}, "variable": {}, "output": {}}
    for path in sorted((TF_ROOT / name).glob("*.tf")):
        with path.open() as handle:
            parsed = clean(hcl2.load(handle))
        for entry in parsed.get("resource", []):
            for rtype, by_name in entry.items():
                for rname, body in by_name.items():
                    module["resource"][(rtype, rname)] = body
        for entry in parsed.get("locals", []):
            module["locals"].update(entry)
        for key in ("variable", "output"):
            for entry in parsed.get(key, []):
                module[key].update(entry)
    return module


def block(body: dict[str, Any], *path: str) -> Any:
    """Follow nested blocks (each parsed as a one-element list) and attributes."""
    node: Any = body
    for key in path:
        node = node[key]
        if isinstance(node, list) and len(node) == 1 and isinstance(node[0], dict):
            node = node[0]
    return node


_REF = re.compile(r"\$\{(local|var)\.([A-Za-z0-9_]+)\}")
# `${local.map[var.key]}`: a map of literals indexed by a variable (its default, or `given`).
_LOOKUP = re.compile(r"\$\{local\.(\w+)\[var\.(\w+)\]\}")
_DEFAULT_OR = re.compile(r'\$\{var\.(\w+) != "" \? var\.\1 : "(.*)"\}')


def resolve(
    module: dict[str, Any], text: str, module_dir: Path, given: dict[str, str] | None = None
) -> str:
    """Expand `${local.x}`, `${var.x}` (defaults, or `given`), `${local.map[var.x]}` and
    `${path.module}` in a string."""
    given = given or {}

    def variable(name: str) -> Any:
        return given[name] if name in given else module["variable"][name]["default"]

    def lookup(match: re.Match[str]) -> str:
        table, key = match.groups()
        return module["locals"][table][variable(key)]

    def sub(match: re.Match[str]) -> str:
        kind, name = match.groups()
        if kind == "local":
            value = module["locals"][name]
        else:
            value = variable(name)
        assert isinstance(value, str), f"{kind}.{name} is not a plain string: {value!r}"
        return resolve(module, value, module_dir, given)

    # `var.x != "" ? var.x : "fallback"`: with the variable at its default "", the fallback.
    fallback = _DEFAULT_OR.fullmatch(text)
    if fallback and module["variable"][fallback.group(1)].get("default") == "":
        text = fallback.group(2)
    previous = None
    while previous != text:
        previous = text
        text = _LOOKUP.sub(lookup, text)
        text = _REF.sub(sub, text).replace("${path.module}", str(module_dir))
    return text


def walk(node: Any, trail: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{trail}.{key}", value
            yield from walk(value, f"{trail}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{trail}[{i}]")


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return load_module("cluster")


@pytest.fixture(scope="module")
def workloads() -> dict[str, Any]:
    return load_module("workloads")


# --- every file, every variable --------------------------------------------------------------


def test_there_are_two_root_modules_with_terraform_files() -> None:
    for name in MODULES:
        assert list((TF_ROOT / name).glob("*.tf")), f"no .tf files in infra/terraform/{name}"


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(TF_ROOT)))
def test_every_tf_file_parses(path: Path) -> None:
    with path.open() as handle:
        assert isinstance(hcl2.load(handle), dict)


@pytest.mark.parametrize("name", MODULES)
def test_every_variable_and_output_is_described(name: str) -> None:
    module = load_module(name)
    assert module["variable"], f"{name} declares no variables"
    for kind in ("variable", "output"):
        for key, body in module[kind].items():
            assert str(body.get("description", "")).strip(), f"{name}: {kind} {key} undescribed"


# --- cluster: node groups, bucket, operator --------------------------------------------------


def test_gpu_node_group_is_driven_by_variables(cluster: dict[str, Any]) -> None:
    gpu = cluster["resource"][("nebius_mk8s_v1_node_group", "gpu")]
    template = gpu["template"]
    assert template["resources"] == {
        "platform": "${var.gpu_platform}",
        "preset": "${var.gpu_preset}",
    }
    assert template["gpu_settings"] == {"drivers_preset": "${var.gpu_drivers_preset}"}
    assert "var.gpu_preemptible" in template["preemptible"]
    assert gpu["autoscaling"] == {
        "min_node_count": "${var.gpu_min_nodes}",
        "max_node_count": "${var.gpu_max_nodes}",
    }
    variables = cluster["variable"]
    assert variables["gpu_platform"]["default"] == "gpu-h200-sxm"
    assert re.fullmatch(r"\d+gpu-\d+vcpu-\d+gb", variables["gpu_preset"]["default"])
    assert variables["gpu_preemptible"]["type"] == "bool"
    assert variables["gpu_min_nodes"]["default"] <= variables["gpu_max_nodes"]["default"]
    cpu = cluster["resource"][("nebius_mk8s_v1_node_group", "cpu")]
    assert "gpu_settings" not in cpu["template"]


def test_bucket_aborts_incomplete_multipart_uploads(cluster: dict[str, Any]) -> None:
    bucket = cluster["resource"][("nebius_storage_v1_bucket", "data")]
    rules = bucket["lifecycle_configuration"]["rules"]
    aborting = [r for r in rules if "abort_incomplete_multipart_upload" in r]
    assert aborting, "no lifecycle rule aborts incomplete multipart uploads"
    rule = aborting[0]
    assert rule["status"] == "ENABLED"
    days = rule["abort_incomplete_multipart_upload"]["days_after_initiation"]
    assert days == "${var.abort_incomplete_multipart_days}"
    assert cluster["variable"]["abort_incomplete_multipart_days"]["default"] >= 1


def test_kuberay_operator_comes_from_its_helm_repository(cluster: dict[str, Any]) -> None:
    release = cluster["resource"][("helm_release", "kuberay_operator")]
    assert release["chart"] == "kuberay-operator"
    assert "kuberay-helm" in release["repository"]
    assert release["version"] == "${var.kuberay_chart_version}"


# --- workloads: the nightly CronJob ----------------------------------------------------------


def _cron_job(workloads: dict[str, Any]) -> dict[str, Any]:
    return workloads["resource"][("kubernetes_cron_job_v1", "nightly")]


def _nightly_pod(workloads: dict[str, Any]) -> dict[str, Any]:
    return block(_cron_job(workloads), "spec", "job_template", "spec", "template", "spec")


def test_cron_job_never_overlaps_and_has_a_starting_deadline(workloads: dict[str, Any]) -> None:
    spec = block(_cron_job(workloads), "spec")
    assert spec["concurrency_policy"] == "Forbid"
    assert spec["schedule"] == "${var.nightly_schedule}"
    assert len(workloads["variable"]["nightly_schedule"]["default"].split()) == 5
    assert spec["starting_deadline_seconds"] == "${var.nightly_starting_deadline_seconds}"
    assert workloads["variable"]["nightly_starting_deadline_seconds"]["default"] > 0
    assert block(_nightly_pod(workloads), "restart_policy") == "Never"


def test_cron_job_runs_the_same_command_as_the_e2e_test(workloads: dict[str, Any]) -> None:
    container = block(_nightly_pod(workloads), "container")
    assert container["command"] == ["/bin/sh", "-c", "${local.nightly_command}"]
    template = workloads["locals"]["nightly_command"]
    # Structurally the template of pipeline.submit, with the two locals as placeholders ...
    assert template == nightly_submit_shell("${local.nightly_job_path}", "${local.dashboard_url}")
    # ... and fully expanded, the argv the e2e test runs, with the date left to the shell.
    module_dir = TF_ROOT / "workloads"
    command = resolve(workloads, template, module_dir)
    job_path = resolve(workloads, workloads["locals"]["nightly_job_path"], module_dir)
    address = resolve(workloads, workloads["locals"]["dashboard_url"], module_dir)
    assert shlex.split(command) == nightly_submit_argv(job_path, address, "$(date -u +%F)")
    assert NIGHTLY_DATE_EXPR in command
    assert address.endswith(":8265") and "-head-svc." in address


def test_cron_job_mounts_the_nightly_job_file_from_the_repository(
    workloads: dict[str, Any],
) -> None:
    module_dir = TF_ROOT / "workloads"
    config_map = workloads["resource"][("kubernetes_config_map_v1", "jobs")]
    job_path = resolve(workloads, workloads["locals"]["nightly_job_path"], module_dir)
    key = Path(job_path).name
    assert config_map["data"][key] == "${file(local.nightly_job_file)}"
    source = Path(resolve(workloads, workloads["locals"]["nightly_job_file"], module_dir))
    assert source.resolve() == REPO / "jobs" / "nightly.yaml"
    # file() fails the plan on a missing file, and the submitter pod validates the job with no
    # storage variables set: both must hold for the repository's nightly job.
    spec = load_job_spec(source, date="2026-01-01", env={})
    assert "2026-01-01" in spec.output.uri
    pod = _nightly_pod(workloads)
    mounts = block(pod, "container")["volume_mount"]
    config_dir = resolve(workloads, workloads["locals"]["config_dir"], module_dir)
    assert str(Path(job_path).parent) == config_dir
    assert any(m["mount_path"] == "${local.config_dir}" and m["read_only"] for m in mounts)


def test_cron_job_gets_the_ray_token_from_a_secret(workloads: dict[str, Any]) -> None:
    env = {e["name"]: e for e in block(_nightly_pod(workloads), "container")["env"]}
    ref = block(env["RAY_AUTH_TOKEN"], "value_from", "secret_key_ref")
    assert ref == {"name": "${var.ray_auth_secret}", "key": "auth_token"}
    assert "value" not in env["RAY_AUTH_TOKEN"]


# --- workloads: Ray clusters and Serve -------------------------------------------------------


def test_batch_cluster_autoscales_gpu_workers(workloads: dict[str, Any]) -> None:
    manifest = workloads["resource"][("kubernetes_manifest", "batch_cluster")]["manifest"]
    assert manifest["kind"] == "RayCluster"
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] == "${var.batch_min_workers}"
    assert group["maxReplicas"] == "${var.batch_max_workers}"
    assert spec["authOptions"] == "${local.auth_options}"
    assert workloads["locals"]["auth_options"]["mode"] == "token"
    container = workloads["locals"]["gpu_worker_template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "${var.gpus_per_worker}"
    assert local_name(workloads["locals"]["dashboard_url"]) == "batch_cluster_name"
    assert manifest["metadata"]["name"] == "${local.batch_cluster_name}"


def local_name(url_template: str) -> str:
    """The local whose value names the head Service in a `http://${local.X}-head-svc...` URL."""
    match = re.match(r"http://\$\{local\.([a-z_]+)\}-head-svc\.", url_template)
    assert match, url_template
    return match.group(1)


def test_ray_service_serves_the_serve_yaml(workloads: dict[str, Any]) -> None:
    manifest = workloads["resource"][("kubernetes_manifest", "serve")]["manifest"]
    assert manifest["kind"] == "RayService"
    assert manifest["spec"]["serveConfigV2"] == "${local.serve_config_v2}"
    serve_config = workloads["locals"]["serve_config_v2"]
    apps = re.findall(
        r'\{name = ([^,]+), import_path = "([^"]+)", route_prefix = "([^"]+)"', serve_config
    )
    # The app at / and its two probe apps (pipeline/serve/http/probes.py): /ready watches the app
    # named in its args.
    main = "local.serve_app_name"
    assert [(n, r) for n, _, r in apps] == [
        (main, "/"),
        ('"${local.serve_app_name}-ready"', "/ready"),
        ('"${local.serve_app_name}-health"', "/health"),
    ], apps
    assert f"args = {{config = local.serve_config_path, app = {main}}}" in serve_config
    assert "local.serve_config_path" in serve_config
    module_dir = TF_ROOT / "workloads"
    serve_path = resolve(workloads, workloads["locals"]["serve_config_path"], module_dir)
    config_map = workloads["resource"][("kubernetes_config_map_v1", "jobs")]
    assert config_map["data"][Path(serve_path).name] == "${local.serve_config_yaml}"
    # Without a keys-file secret the file goes in as written.
    rendered = workloads["locals"]["serve_config_yaml"]
    assert rendered.startswith(
        "${var.serve_keys_file_secret == null ? local.serve_config_text : "
    ), rendered
    assert workloads["locals"]["serve_config_text"] == "${file(local.serve_config_file)}"
    source = Path(resolve(workloads, workloads["locals"]["serve_config_file"], module_dir))
    assert source.resolve() == REPO / "jobs" / "serve-gpu.yaml"
    assert load_serve_spec(source, env={}).models
    # Each import path names a builder that exists (checked without importing Ray Serve).
    for _, import_path, _ in apps:
        module_name, func = import_path.split(":")
        tree = ast.parse((REPO / Path(*module_name.split("."))).with_suffix(".py").read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    # Serve pods receive the accepted API keys from a secret.
    env = workloads["locals"]["serve_keys_env"]
    assert env["name"] == "TOKENMILL_API_KEYS"
    assert env["valueFrom"]["secretKeyRef"]["name"] == "${var.serve_api_keys_secret}"


def test_serve_engine_trtllm_serves_from_the_images_serve_environment(
    workloads: dict[str, Any],
) -> None:
    """serve_engine picks the Serve file, and with "trtllm" Ray on the Serve pods starts under
    the TensorRT-LLM image's Serve environment (images/trtllm.Dockerfile), the engine process
    under the container's Python (the file's replicas.engine_python)."""
    module_dir = TF_ROOT / "workloads"
    file_of = {}
    for engine in ("vllm", "trtllm"):
        text = workloads["locals"]["serve_config_file"]
        path = Path(resolve(workloads, text, module_dir, {"serve_engine": engine}))
        file_of[engine] = path.resolve()
        (model,) = load_serve_spec(path, env={}).models
        assert model.engine.kind == engine
    assert file_of["vllm"] == REPO / "jobs" / "serve-gpu.yaml"
    assert file_of["trtllm"] == REPO / "jobs" / "serve-gpu-trtllm.yaml"
    assert workloads["variable"]["serve_engine"]["default"] == "vllm"
    (trtllm,) = load_serve_spec(file_of["trtllm"], env={}).models
    assert trtllm.replicas.engine_python  # the container's Python runs the engine
    # Our command in place of KubeRay's, on both groups, only for "trtllm".
    local = workloads["locals"]
    assert local["serve_annotations"].startswith('${var.serve_engine == "trtllm" ? ')
    assert '"ray.io/overwrite-container-cmd" = "true"' in local["serve_annotations"]
    command = local["serve_container_cmd"]
    assert command.startswith('${var.serve_engine == "trtllm" ? ')
    serve_env = re.search(
        r"-m venv [^/]*(/opt/[\w-]+)", (REPO / "images/trtllm.Dockerfile").read_text()
    )
    assert serve_env, "images/trtllm.Dockerfile makes no Serve environment"
    assert f"export PATH={serve_env.group(1)}/bin:$PATH" in command
    assert "ulimit -n 65536" in command and command.index("PATH=") < command.index(
        "$KUBERAY_GEN_RAY_START_CMD"
    )
    rayservice = (TF_ROOT / "workloads" / "rayservice.tf").read_text()
    assert rayservice.count("merge(c, local.serve_container_cmd, {") == 2  # head and workers
    manifest = workloads["resource"][("kubernetes_manifest", "serve")]["manifest"]
    assert manifest["metadata"]["annotations"] == "${local.serve_annotations}"


def test_serve_pods_mount_the_keys_file_secret_where_the_serve_yaml_points(
    workloads: dict[str, Any], tmp_path: Path
) -> None:
    module_dir = TF_ROOT / "workloads"
    variable = workloads["variable"]["serve_keys_file_secret"]
    assert variable["default"] is None  # opt-in
    path = resolve(workloads, workloads["locals"]["serve_keys_file_path"], module_dir)
    mount_dir = resolve(workloads, workloads["locals"]["serve_keys_dir"], module_dir)
    assert path == f"{mount_dir}/keys.yaml"
    assert mount_dir != workloads["locals"]["config_dir"]  # a volume of its own
    # The serve YAML's auth.keys_file is set to that path, other auth settings kept.
    rendered = workloads["locals"]["serve_config_yaml"]
    assert "yamlencode(merge(yamldecode(local.serve_config_text)" in rendered
    assert "auth = merge(try(yamldecode(local.serve_config_text).auth, null)" in rendered
    assert "{keys_file = local.serve_keys_file_path}" in rendered
    # The secret is a whole-directory read-only mount (a subPath mount would never see an
    # update of the secret, and the replicas reload the file on change).
    volumes = workloads["locals"]["serve_keys_file_volumes"]
    mounts = workloads["locals"]["serve_keys_file_mounts"]
    for expression in (volumes, mounts):
        assert expression.startswith("${var.serve_keys_file_secret == null ? [] : [{")
    assert "secretName = var.serve_keys_file_secret" in volumes
    assert '{key = "keys.yaml", path = "keys.yaml"}' in volumes
    assert "mountPath = local.serve_keys_dir" in mounts and "readOnly = true" in mounts
    assert "subPath" not in mounts
    # Head and GPU workers alike get the volume and its mount.
    head = workloads["locals"]["serve_head_group"]
    worker = workloads["locals"]["serve_worker_template"]["spec"]
    for template in (head, worker):
        assert "concat(c.volumeMounts, local.serve_keys_file_mounts)" in template
        assert "local.serve_keys_file_volumes)" in template
    # What the rendered serve YAML amounts to is a valid serve file naming that keys file.
    source = Path(resolve(workloads, workloads["locals"]["serve_config_file"], module_dir))
    data = yaml.safe_load(source.read_text())
    data["auth"] = {**(data.get("auth") or {}), "keys_file": path}
    rendered = tmp_path / "serve.yaml"  # as the replicas load it: ${VAR} defaults applied
    rendered.write_text(yaml.safe_dump(data))
    spec = load_serve_spec(rendered, env={})
    assert spec.auth.keys_file == "/etc/tokenmill/serve-keys/keys.yaml"
    assert spec.auth.api_keys_env == load_serve_spec(source, env={}).auth.api_keys_env


def test_every_container_image_is_a_variable(workloads: dict[str, Any]) -> None:
    images = [
        (trail, value)
        for tree in (workloads["resource"], workloads["locals"])
        for trail, value in walk({str(k): v for k, v in tree.items()})
        if trail.endswith(".image")
    ]
    assert len(images) >= 4  # Ray head, GPU worker, autoscaler, nightly submitter
    by_role = {
        "${var.batch_head_image}",
        "${var.batch_gpu_image}",
        "${var.serve_head_image}",
        "${var.serve_gpu_image}",
        "${local.submitter_image}",
    }
    assert {value for _, value in images} <= by_role, images
    assert workloads["locals"]["submitter_image"].count("var.batch_head_image") == 1
    # The Serve cluster's head, workers and autoscaler get the Serve images, not batch's.
    serve = workloads["resource"][("kubernetes_manifest", "serve")]["manifest"]["spec"]
    assert "image = var.serve_head_image" in serve["rayClusterConfig"]["autoscalerOptions"]
    assert "image = var.serve_head_image" in workloads["locals"]["serve_head_group"]
    worker = workloads["locals"]["serve_worker_template"]["spec"]
    assert "image = var.serve_gpu_image" in worker


# --- secrets ---------------------------------------------------------------------------------

_SECRET_LITERALS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(secret|password|token|api_keys?)\s*=\s*\"[^\"$]{8,}\""),
]


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: str(p.relative_to(TF_ROOT)))
def test_no_literal_secrets(path: Path) -> None:
    text = path.read_text()
    for pattern in _SECRET_LITERALS:
        assert not pattern.search(text), f"{path.name}: literal secret matching {pattern.pattern}"


@pytest.mark.parametrize("name", MODULES)
def test_credentials_come_from_secret_refs_or_sensitive_inputs(name: str) -> None:
    module = load_module(name)
    sensitive_names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN")
    for trail, value in walk({str(k): v for k, v in module["resource"].items()}):
        if isinstance(value, dict) and value.get("name") in sensitive_names:
            assert "value" not in value, f"{trail}: {value['name']} set from a literal"
    for local in module["locals"].values():
        for _, value in walk(local):
            if isinstance(value, dict) and value.get("name") in sensitive_names:
                assert "secretKeyRef" in value.get("valueFrom", {}), value
    for var_name, body in module["variable"].items():
        if "token" in var_name or "password" in var_name:
            assert body.get("sensitive") is True, f"variable {var_name} must be sensitive"
            assert "default" not in body, f"variable {var_name} must have no default"


# --- checkov ---------------------------------------------------------------------------------


CHECKOV_FLAGS = ("--compact", "--quiet", "-o", "json")


def _checkov() -> Path | None:
    path = Path(os.environ.get("TOKENMILL_CHECKOV", REPO / ".venv-checkov" / "bin" / "checkov"))
    return path if path.is_file() else None


def test_every_checkov_skip_is_justified() -> None:
    for path in TF_FILES:
        for line in path.read_text().splitlines():
            if "checkov:skip=" in line:
                assert re.search(r"checkov:skip=CKV\w*_\d+:\s*\S+", line), f"{path.name}: {line}"


@pytest.mark.skipif(_checkov() is None, reason="checkov not installed (set TOKENMILL_CHECKOV)")
def test_checkov_reports_no_failed_checks() -> None:
    checkov = _checkov()
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE")  # offline: no guideline download
    proc = subprocess.run(
        [str(checkov), "-d", str(TF_ROOT), "--framework", "terraform", *CHECKOV_FLAGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.stdout.strip(), proc.stderr[-2000:]
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
        for report in reports
        for c in report.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "\n".join(failed)
    summary = reports[0].get("summary", {})
    assert summary.get("parsing_errors", 0) == 0
    assert summary.get("resource_count", 0) >= 8


def test_network_policy_keeps_the_dashboard_inside(workloads: dict[str, Any]) -> None:
    policy = workloads["resource"][("kubernetes_network_policy_v1", "ray")]
    spec = block(policy, "spec")
    assert spec["policy_types"] == ["Ingress"]
    rules = spec["ingress"] if isinstance(spec["ingress"], list) else [spec["ingress"]]
    for rule in rules:
        if "from" not in rule:  # open to every source: only the Serve port may be
            ports = rule["ports"] if isinstance(rule["ports"], list) else [rule["ports"]]
            assert [p["port"] for p in ports] == ["8000"]
    assert any("from" in rule for rule in rules)
