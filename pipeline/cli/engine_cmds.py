"""Engine-level commands: build a tiny model, benchmark an engine."""

from __future__ import annotations

from pathlib import Path

import typer

from engines.dev.bench import MODES, BenchConfig, format_summary, run_bench
from engines.dev.tiny import ARCHS
from engines.dev.tiny import make_tiny_model as build
from pipeline.cli.app import app


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Path = typer.Argument(..., help="Directory to write the Hugging Face model to."),
    arch: str = typer.Option(
        "llama",
        help="Architecture: llama, qwen2, qwen3, qwen3_moe, gpt_oss or qwen2_5_vl (with its "
        "image processor).",
    ),
    size: str = typer.Option("tiny", help="Preset: tiny (~0.3M params) or small (~35M)."),
    tied: bool = typer.Option(False, help="Tie the input embedding and the LM head."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the weights."),
    reasoning: str = typer.Option(
        "none",
        help="Reasoning tokens and chat template: none, think (<think>/</think>, honours "
        "enable_thinking) or harmony (GPT-OSS message markers).",
    ),
    mxfp4: bool = typer.Option(
        False, help="gpt_oss: store the experts MXFP4-packed, as the released checkpoints."
    ),
) -> None:
    """Train a byte-level BPE tokenizer locally and save a random model with it."""

    try:
        path = build(
            out_dir,
            arch=arch,
            size=size,
            tie_word_embeddings=tied,
            seed=seed,
            reasoning=reasoning,  # type: ignore[arg-type]  # checked by build
            mxfp4=mxfp4,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {arch} ({size}) model to {path}")


@app.command("bench")
def bench(
    model: Path | None = typer.Option(
        None,
        help="Hugging Face model dir. Default: the `small` tiny model of --arch (~35M parameters "
        "as a Llama), built once.",
    ),
    arch: str = typer.Option(
        "llama",
        help="Without --model: the tiny model built (llama, qwen2, qwen3 or qwen3_moe; "
        "qwen3_moe also reports the reference engine's expert load).",
    ),
    num_prompts: int = typer.Option(128, min=1, help="Requests in the workload."),
    min_prompt_len: int = typer.Option(16, min=1, help="Shortest prompt, in tokens."),
    max_prompt_len: int = typer.Option(512, min=1, help="Longest prompt, in tokens."),
    min_max_tokens: int = typer.Option(8, min=1, help="Fewest tokens a request generates."),
    max_max_tokens: int = typer.Option(256, min=1, help="Most tokens a request generates."),
    seed: int = typer.Option(0, help="Workload seed (prompt ids and lengths)."),
    modes: str = typer.Option(
        "reference,hf-static,hf-continuous",
        help="Comma-separated modes to run, in order: reference, hf-static, hf-continuous, vllm.",
    ),
    threads: int | None = typer.Option(None, min=1, help="Torch threads per mode (all cores)."),
    static_batch_size: int = typer.Option(32, min=1, help="hf-static: requests per batch."),
    max_batch_size: int = typer.Option(128, min=1, help="Requests in flight (reference, CB)."),
    max_num_tokens: int = typer.Option(2048, min=1, help="Tokens per step (reference, CB)."),
    mode_timeout: float = typer.Option(
        1200.0, min=1, help="Seconds a mode may run before it is reported as failed."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the numbers here."),
    vllm_python: Path | None = typer.Option(
        None, help="vllm mode: the Python of vLLM's environment (default: .venv-vllm's)."
    ),
    vllm_eager: bool = typer.Option(
        False, help="vllm mode: no graph compilation (starts in seconds; slower steps)."
    ),
    profile: Path | None = typer.Option(
        None,
        help="reference mode: record engine steps with torch.profiler, write the Chrome / "
        "Perfetto trace to this directory and print the time per step phase.",
    ),
    profile_steps: int = typer.Option(
        50, min=1, help="With --profile: engine steps to record (from the first)."
    ),
    rounds: int = typer.Option(
        1,
        min=1,
        help="Run the modes this many times, in turn; ratios are taken within each round and "
        "their median is reported (one run on a shared machine moves by ~5%).",
    ),
) -> None:
    """Compare the reference engine with transformers (static and continuous batching) and,
    with mode vllm, with vLLM (its CPU build, in .venv-vllm: `make setup-vllm`).

    Prints useful generated tokens/s, TTFT p50/p95 and peak RSS per mode, the speed-up over
    the best transformers mode and over vLLM, and decode FLOP/s against this CPU's matmul
    FLOP/s. With --profile, also the reference engine's time per step phase (docs/engine.md).
    """
    import json

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if min_prompt_len > max_prompt_len or min_max_tokens > max_max_tokens:
        raise typer.BadParameter("each --min-* must be <= its --max-*")
    if arch not in ARCHS:
        raise typer.BadParameter(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}")
    config = BenchConfig(
        model=str(model) if model else None,
        arch=arch,
        num_prompts=num_prompts,
        prompt_len=(min_prompt_len, max_prompt_len),
        max_tokens=(min_max_tokens, max_max_tokens),
        seed=seed,
        modes=chosen,
        threads=threads,
        static_batch_size=static_batch_size,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        mode_timeout_s=mode_timeout,
        vllm_python=str(vllm_python) if vllm_python else None,
        vllm_eager=vllm_eager,
        profile_dir=str(profile.resolve()) if profile else None,
        profile_steps=profile_steps,
        rounds=rounds,
    )
    report = run_bench(config, log=typer.echo)
    summary = format_summary(report)
    if summary:
        typer.echo(summary)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(), indent=2))
        typer.echo(f"wrote {json_path}")
    if any(r.error for r in report.results):
        raise typer.Exit(1)
