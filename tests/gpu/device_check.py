"""The device check: one command on a GPU machine, inside images/trtllm.Dockerfile's image.

    python tests/gpu/device_check.py --prepare-only --out DIR --device cpu  # quantize extra's env
    python tests/gpu/device_check.py --out DIR          # in the image: < 8 min on one H200
    python tests/gpu/device_check.py --engines reference   # where TensorRT-LLM is absent

1. `tokenmill doctor --require cuda` (and trtllm / fp8 when those runs are asked for): a
   conflict stops the check before anything is built.
2. A ~1B Llama (engines.dev.tiny size "1b": random weights, a tokenizer trained here, no
   download) saved in bf16, and its FP8 export by tokenmill's own quantize step (FP8 weights,
   activations and KV cache scales). The build needs the quantize extra's ModelOpt, which
   TensorRT-LLM's container lacks: run `--prepare-only --out DIR` first where the extra is
   (any machine, CPU included), then the check with the same `--out DIR` in the image.
3. The same job, `--rows` prompts (greedy, fixed output length), through `tokenmill run` for
   every engine x checkpoint, one at a time on the same GPU, on a local Ray.
4. Per run: output tokens/s (completion tokens / the job's wall time, and per paid device
   second), cost per 1M output tokens at `--device-hour-usd`; per checkpoint: greedy agreement
   of TensorRT-LLM with the reference engine (rows with the same text; shared leading
   characters). A table on stdout, the numbers as JSON in --out/report.json.

5. With trtllm among the engines: TensorRT-LLM's own behaviours on the bf16 model
   (tests/gpu/library_checks.py): sampled rows under n-gram speculation differ from greedy,
   logprobs of sampled rows are all there, and the GPU memory CUDA graphs take at the
   adapter's default capture (256) against the library's 2,048 and none. In report.json
   under "library"; `--no-library-checks` leaves them out.

6. Where Serve's environment is (`--serve-env`, default /opt/serve-env/bin when it exists:
   images/trtllm.Dockerfile's): the first engine's last checkpoint (TensorRT-LLM on the FP8
   export, as jobs/serve-gpu-trtllm.yaml serves the nightly's) served by `tokenmill serve` from
   that environment, its engine process under this interpreter (replicas.engine_python):
   requests/s, time to first token and agreement with the batch run (tests/gpu/serve_check.py).
   In report.json under "serve"; `--serve-env none` leaves it out.

Random weights make agreement a numerics check, not a quality one: FP8 GEMMs in TensorRT-LLM
run in FP8 while the reference engine dequantizes to bf16, so FP8 streams part sooner. Not run
in CI (no GPU); tests/integration/test_device_check_script.py runs its CPU smoke shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SERVE_ENV = Path("/opt/serve-env/bin")  # images/trtllm.Dockerfile's Serve environment
ENGINE_SETTINGS = {
    "trtllm": {"max_batch_size": 256, "max_num_tokens": 8192, "kv_cache_memory_fraction": 0.5},
    "reference": {"max_batch_size": 256, "max_num_tokens": 8192},
}


def doctor(requires: list[str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pipeline.cli", "doctor", "--json"]
    for name in requires:
        argv += ["--require", name]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"tokenmill doctor found problems:\n{proc.stderr}")
    print(proc.stderr.strip())
    return json.loads(proc.stdout)


def build_checkpoints(work: Path, size: str, fp8: bool, device: str) -> dict[str, Path]:
    """The bf16 model and its FP8 export under `work`, built unless already there.

    The FP8 build needs the quantize extra's ModelOpt, which TensorRT-LLM's container lacks
    (docs/deploy.md): there, prepare both first elsewhere (`--prepare-only`, CPU is fine) into
    the same --out, and this run finds and uses them."""
    from engines.dev.tiny import make_tiny_model
    from engines.quantize.artifacts import MARKER, build_or_reuse
    from engines.quantize.config import QuantizationSpec

    base, export = work / "bf16", work / "fp8"
    if not (base / "config.json").is_file():
        started = time.monotonic()
        # A gentler init than the tests' tiny models: at hidden 2048 theirs saturates softmax.
        make_tiny_model(base, size=size, torch_dtype="bfloat16", initializer_range=0.05)
        print(f"model {size} (bf16) written in {time.monotonic() - started:.0f} s")
    checkpoints = {"bf16": base}
    if fp8:
        if not (export / MARKER).is_file():
            started = time.monotonic()
            spec = QuantizationSpec(
                format="fp8", kv_cache="fp8", device=device, allow_quality_failure=True
            )
            build_or_reuse(base, str(export), spec)
            print(f"FP8 export built in {time.monotonic() - started:.0f} s")
        checkpoints["fp8"] = export
    return checkpoints


def write_prompts(path: Path, model: Path, rows: int) -> None:
    from engines.quantize.calibration import sample_text

    sentences = sample_text(rows * 3, seed=11)
    with path.open("w") as out:
        for i in range(rows):
            prompt = " ".join(sentences[3 * i : 3 * i + 3])
            out.write(json.dumps({"id": f"row-{i:05d}", "prompt": prompt}) + "\n")


def read_prompts(path: Path) -> dict[str, str]:
    rows = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {row["id"]: row["prompt"] for row in rows}


def job_file(work: Path, name: str, engine: str, model: Path, args: argparse.Namespace) -> Path:
    settings = dict(ENGINE_SETTINGS[engine])
    if engine == "reference":
        settings["device"] = args.device
    if name.endswith("fp8"):
        settings["kv_cache_dtype"] = "fp8"
    job = {
        "name": f"device-check-{name}",
        "input": {
            "uri": str(work / "prompts.jsonl"),
            "format": "jsonl",
            "id_column": "id",
            "prompt_column": "prompt",
        },
        "model": {"path": str(model), "name": name},
        "engine": {"kind": engine, "dtype": "bfloat16" if args.device == "cuda" else "float32"}
        | settings,
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "resources": {
            "num_actors": 1,
            "devices_per_actor": 1 if args.device == "cuda" else 0,
            "cpus_per_actor": 1 if args.device == "cuda" else 0.5,
            "max_in_flight": 512,
        },
        "output": {"uri": str(work / "out" / name)},
        "cost": {"device_hour_usd": args.device_hour_usd},
    }
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def run_job(path: Path, timeout_s: float) -> float:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{path.name}: tokenmill run exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    return time.monotonic() - started


def read_output(out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Texts by id from the committed output, and the report summary."""
    import pyarrow.parquet as pq

    from pipeline.report import build_report
    from pipeline.spec import StorageSpec
    from pipeline.storage import OutputDir

    assert (out / "_SUCCESS").exists(), f"{out} is not a complete output"
    manifest = json.loads((out / "_manifest.json").read_text())
    texts: dict[str, str] = {}
    for part in manifest["parts"]:
        table = pq.read_table(out / part["name"], columns=["id", "text", "error"])
        for row in table.to_pylist():
            assert row["error"] is None, f"{out}: row {row['id']}: {row['error']}"
            texts[row["id"]] = row["text"]
    summary, _, _ = build_report(OutputDir(str(out), StorageSpec()), plots=False)
    return texts, summary.to_dict()


def agreement(a: dict[str, str], b: dict[str, str]) -> dict[str, float]:
    """Rows with the same text, and the mean share of leading characters in common."""
    from engines.quantize.quality import matched_prefix

    same = sum(a[k] == b[k] for k in a)
    prefix = sum(matched_prefix(list(a[k]), list(b[k])) / max(1, len(a[k])) for k in a)
    return {"same_text": round(same / len(a), 3), "shared_prefix": round(prefix / len(a), 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="trtllm,reference")
    parser.add_argument("--checkpoints", default="bf16,fp8")
    parser.add_argument("--size", default="1b", help="engines.dev.tiny size (1b, small, tiny)")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--device-hour-usd", type=float, default=3.50)  # Nebius H200
    parser.add_argument("--out", type=Path, default=Path("device-check"))
    parser.add_argument("--job-timeout-s", type=float, default=600)
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="Build the model and its FP8 export into --out and stop (for an environment with "
        "the quantize extra; the check then runs where the engines are)",
    )
    parser.add_argument(
        "--serve-env",
        default=str(DEFAULT_SERVE_ENV) if DEFAULT_SERVE_ENV.is_dir() else "none",
        help="bin/ of the environment with Serve (its `tokenmill`); the engine process runs "
        "under this interpreter. `none`: no Serve step",
    )
    parser.add_argument(
        "--no-library-checks",
        dest="library_checks",
        action="store_false",
        help="Skip TensorRT-LLM's sampling, logprobs and CUDA graph memory checks",
    )
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    kinds = [c for c in args.checkpoints.split(",") if c]

    started = time.monotonic()
    if args.prepare_only:
        work = args.out.resolve()
        build_checkpoints(work / "models", args.size, "fp8" in kinds, args.device)
        return {"prepared": str(work / "models")}
    requires = ["cuda"] if args.device == "cuda" else []
    requires += ["trtllm"] if "trtllm" in engines else []
    requires += ["fp8"] if "fp8" in kinds and args.device == "cuda" else []
    report: dict[str, Any] = {"doctor": doctor(requires)["findings"], "runs": {}}
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = build_checkpoints(work / "models", args.size, "fp8" in kinds, args.device)
    write_prompts(work / "prompts.jsonl", checkpoints["bf16"], args.rows)
    texts: dict[str, dict[str, str]] = {}
    for kind in kinds:
        for engine in engines:
            name = f"{engine}-{kind}"
            seconds = run_job(
                job_file(work, name, engine, checkpoints[kind], args), args.job_timeout_s
            )
            texts[name], summary = read_output(work / "out" / name)
            cost = summary["cost"]
            report["runs"][name] = {
                "rows": summary["rows"],
                "completion_tokens": cost["completion_tokens"],
                "command_s": round(seconds, 1),
                "job_wall_s": round(summary["wall_s"], 1),
                "output_tokens_per_s": round(summary["output_tokens_per_s"] or 0, 1),
                "output_tokens_per_s_per_device": round(
                    cost["output_tokens_per_s_per_device"] or 0, 1
                ),
                "usd_per_million_output": cost["usd_per_million_output"],
                "busy_fraction": round(cost["busy_fraction"], 3),
            }
        if "trtllm" in engines and "reference" in engines:
            report[f"agreement_{kind}"] = agreement(
                texts[f"trtllm-{kind}"], texts[f"reference-{kind}"]
            )
    if "bf16" in kinds and "fp8" in kinds:
        for engine in engines:
            report[f"agreement_fp8_vs_bf16_{engine}"] = agreement(
                texts[f"{engine}-bf16"], texts[f"{engine}-fp8"]
            )
    if "trtllm" in engines and args.library_checks:
        from tests.gpu.library_checks import run_all

        report["library"] = run_all(checkpoints["bf16"], min(args.rows, 64), args.max_tokens)
    if args.serve_env != "none":
        from tests.gpu.serve_check import serve_check

        engine, kind = engines[0], kinds[-1]
        settings = dict(ENGINE_SETTINGS[engine])
        if engine == "reference":
            settings["device"] = args.device
        report["serve"] = serve_check(
            work=work,
            model=checkpoints[kind],
            engine=engine,
            settings=settings,
            serve_bin=Path(args.serve_env),
            engine_python=sys.executable,
            device=args.device,
            prompts=read_prompts(work / "prompts.jsonl"),
            batch_texts=texts[f"{engine}-{kind}"],
            max_tokens=args.max_tokens,
        )
    report["total_s"] = round(time.monotonic() - started, 1)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print(f"{'run':<18} {'rows':>6} {'tok/s':>9} {'tok/s/dev':>9} {'$/1M out':>9} {'wall s':>7}")
    for name, run in report["runs"].items():
        usd = run["usd_per_million_output"]
        print(
            f"{name:<18} {run['rows']:>6} {run['output_tokens_per_s']:>9.1f} "
            f"{run['output_tokens_per_s_per_device']:>9.1f} "
            f"{(f'{usd:.4f}' if usd is not None else '-'):>9} {run['job_wall_s']:>7.1f}"
        )
    for key, value in report.items():
        if key.startswith("agreement") or key in ("library", "serve"):
            print(f"{key}: {value}")
    print(f"total {report['total_s']:.0f} s; report: {work / 'report.json'}")
    return report


if __name__ == "__main__":
    main()
