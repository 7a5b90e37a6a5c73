"""`tokenmill bench`: the reference engine against transformers on one seeded workload.

Modes, each run in its own subprocess so its peak RSS is its own:
- `reference`: every request submitted to ReferenceEngine at once (in-flight batching).
- `hf-static`: transformers `generate` over fixed batches, prompts left-padded; a batch runs
  until its longest max_tokens, but only each request's own max_tokens count as useful.
- `hf-continuous`: transformers' ContinuousBatchingManager (paged attention, per-request
  max_new_tokens).
- `vllm`: the same requests through tokenmill's vLLM engine kind (vLLM's async engine, its
  default compiled graphs), in vLLM's own environment (`make setup-vllm` builds .venv-vllm;
  `--vllm-python` points elsewhere) and pinned to the same number of cores.
EOS is ignored everywhere, so every request produces exactly its max_tokens.

With `profile_dir` the reference mode also records its first `profile_steps` engine steps
with torch.profiler (a Chrome / Perfetto trace in that directory) and reports the time per
step phase read back from the trace; its tokens/s then include the profiler's overhead.

Reported per mode: useful generated tokens/s, TTFT p50/p95 (all requests arrive at t=0), peak
RSS. Also the CPU's fp32 matmul FLOP/s measured in the same run, and the reference engine's
achieved matmul FLOP/s over its pure-decode steps with batch >= 32 (from its step records:
2 x linear params x tokens / step time; attention left out, so this is a lower bound).
On a Mixture-of-Experts model the linear params are those one token multiplies (the router
and its k experts), and the reference mode also reports the expert load from its step
records: tokens per expert per step, the busiest expert's and the mean (ExpertLoadSummary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.api import GenerationRequest, SamplingParams
from engines.dev.tiny import make_tiny_model
from engines.factory import load_engine
from engines.reference.model.config import load_model_config
from engines.reference.runtime.profiling import PhaseTable, format_phase_table, read_phase_table

if TYPE_CHECKING:
    from engines.api import StepRecord

MODES = ("reference", "hf-static", "hf-continuous", "vllm")
# Where `make setup-vllm` puts vLLM's environment, relative to the repository.
_VLLM_VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
_DECODE_BATCH_FOR_FLOPS = 32  # decode steps at least this wide count for achieved FLOP/s


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None  # HF model dir; None builds the tiny `arch` "small" in cache_dir
    arch: str = "llama"  # the engines.dev.tiny architecture built when model is None
    cache_dir: str = str(Path.home() / ".cache" / "tokenmill" / "bench")
    num_prompts: int = 128  # requests in the workload
    prompt_len: tuple[int, int] = (16, 512)  # prompt lengths drawn uniformly in [lo, hi]
    max_tokens: tuple[int, int] = (8, 256)  # output lengths drawn uniformly in [lo, hi]
    seed: int = 0  # workload seed
    modes: tuple[str, ...] = MODES
    threads: int | None = None  # torch threads per mode; None: all cores
    static_batch_size: int = 32  # hf-static: requests per generate() call
    max_batch_size: int = 128  # reference: requests in flight
    max_num_tokens: int = 2048  # reference: tokens per step
    mode_timeout_s: float = 1200.0  # a mode running longer is reported as failed
    vllm_python: str | None = None  # vllm mode: its interpreter; None: .venv-vllm, else this one
    vllm_eager: bool = False  # vllm mode: skip graph compilation (fast start, slower steps)
    profile_dir: str | None = None  # reference mode: write a step trace here (profiling.py)
    profile_steps: int = 50  # reference mode with profile_dir: engine steps the trace records
    # Passes over `modes`, in turn (reference, vllm, reference, vllm, ...). Ratios are taken
    # between the modes of one pass and their median is the headline: on a shared machine one
    # run moves by ~5%, and both engines see the same moment's machine within a pass.
    rounds: int = 1


@dataclass
class ModeResult:
    mode: str
    useful_tokens: int = 0  # sum of each request's max_tokens
    seconds: float = 0.0  # first submission to last result (model load excluded)
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    peak_rss_mb: float = 0.0
    load_s: float = 0.0
    decode_flops_per_s: float | None = None  # reference only: achieved in wide decode steps
    decode_steps_counted: int = 0
    profile: dict | None = None  # reference with profile_dir: profiling.PhaseTable as a dict
    # reference on a Mixture-of-Experts model: ExpertLoadSummary as a dict; None when dense
    expert_load: dict | None = None
    error: str | None = None
    round: int = 0  # the pass over the modes it ran in (BenchConfig.rounds), from 0

    @classmethod
    def measured(
        cls,
        mode: str,
        useful_tokens: int,
        seconds: float,
        ttfts: list[float],
        load_s: float,
        **extra: Any,
    ) -> ModeResult:
        """A finished mode's result; throughput and TTFT percentiles derived the same way for
        every mode so the side-by-side numbers compare like with like."""
        return cls(
            mode=mode,
            useful_tokens=useful_tokens,
            seconds=seconds,
            tokens_per_s=useful_tokens / seconds,
            ttft_p50_s=_percentile(ttfts, 0.5),
            ttft_p95_s=_percentile(ttfts, 0.95),
            load_s=load_s,
            **extra,
        )


@dataclass
class BenchReport:
    config: BenchConfig
    model: str
    threads: int
    matmul_params: int  # parameters in the linears (the LM head included), per token
    matmul_flops_per_s: float  # large fp32 matmul on this machine, same thread count
    # The same through oneDNN with a pre-packed weight, as the engine's linears run (on AMD
    # CPUs about twice torch.matmul, whose MKL sgemm takes its AVX2 code there): the ceiling
    # the decode steps' FLOP/s are also reported against. None where oneDNN is unavailable.
    onednn_flops_per_s: float | None = None
    results: list[ModeResult] = field(default_factory=list)

    def result(self, mode: str) -> ModeResult | None:
        """The mode's first successful result (its first round's, normally)."""
        return next((r for r in self.results if r.mode == mode and r.error is None), None)

    def _rounds(self) -> list[list[ModeResult]]:
        """The successful results of each round, rounds in order."""
        count = max((r.round for r in self.results), default=-1) + 1
        return [[r for r in self.results if r.round == i and r.error is None] for i in range(count)]

    def _ratios(self, is_peer: Callable[[str], bool]) -> list[float]:
        """reference tokens/s over the fastest peer mode's, per round where both ran."""
        ratios = []
        for found in self._rounds():
            ref = next((r for r in found if r.mode == "reference"), None)
            peers = [r.tokens_per_s for r in found if is_peer(r.mode)]
            if ref and peers and max(peers) > 0:
                ratios.append(ref.tokens_per_s / max(peers))
        return ratios

    @property
    def ratios_vs_vllm(self) -> list[float]:
        return self._ratios(lambda mode: mode == "vllm")

    @property
    def ratios_vs_best_hf(self) -> list[float]:
        return self._ratios(lambda mode: mode.startswith("hf-"))

    @property
    def speedup_vs_best_hf(self) -> float | None:
        ratios = self.ratios_vs_best_hf
        return statistics.median(ratios) if ratios else None

    @property
    def speedup_vs_vllm(self) -> float | None:
        ratios = self.ratios_vs_vllm
        return statistics.median(ratios) if ratios else None

    @property
    def decode_flops_per_s(self) -> float | None:
        """The reference engine's wide-decode FLOP/s, the median over its rounds."""
        found = [
            r.decode_flops_per_s
            for r in self.results
            if r.mode == "reference" and r.error is None and r.decode_flops_per_s
        ]
        return statistics.median(found) if found else None

    def _decode_fraction(self, peak: float | None) -> float | None:
        flops = self.decode_flops_per_s
        return flops / peak if flops is not None and peak else None

    @property
    def decode_flops_fraction(self) -> float | None:
        return self._decode_fraction(self.matmul_flops_per_s)

    @property
    def decode_onednn_fraction(self) -> float | None:
        return self._decode_fraction(self.onednn_flops_per_s)

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "speedup_vs_best_hf": self.speedup_vs_best_hf,
            "speedup_vs_vllm": self.speedup_vs_vllm,
            "ratios_vs_best_hf": self.ratios_vs_best_hf,
            "ratios_vs_vllm": self.ratios_vs_vllm,
            "decode_flops_per_s": self.decode_flops_per_s,
            "decode_flops_fraction": self.decode_flops_fraction,
            "decode_onednn_fraction": self.decode_onednn_fraction,
        }


# ---- workload -------------------------------------------------------------------------------
def make_workload(config: BenchConfig, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (random ids, specials excluded) and per-request max_tokens."""
    rng = random.Random(config.seed)
    prompts, max_tokens = [], []
    for _ in range(config.num_prompts):
        length = rng.randint(*config.prompt_len)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])
        max_tokens.append(rng.randint(*config.max_tokens))
    return prompts, max_tokens


def ensure_model(config: BenchConfig) -> Path:
    if config.model:
        return Path(config.model)
    out = Path(config.cache_dir) / f"{config.arch}-small"
    if not (out / "config.json").exists():
        make_tiny_model(out, arch=config.arch, size="small")  # type: ignore[arg-type]
    return out


def matmul_params(model_dir: Path) -> int:
    """Weights multiplied per token: every linear in the layers plus the LM head. A sparse
    (Mixture-of-Experts) layer counts its router and the k experts a token runs, not all E."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    layers = cfg["num_hidden_layers"]
    attn = hidden * head_dim * (2 * heads + 2 * kv)  # q, o, k, v
    mlps = layers * 3 * hidden * inter
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        # Which layers are sparse is the reference engine's reading of the config (one rule).

        moe = load_model_config(model_dir).moe
        if moe is not None:
            sparse = hidden * (
                moe.num_experts + 3 * moe.num_experts_per_tok * moe.intermediate_size
            )
            num_sparse = len(moe.sparse_layers)
            mlps = num_sparse * sparse + (layers - num_sparse) * 3 * hidden * inter
    return layers * attn + mlps + hidden * cfg["vocab_size"]


@dataclass(frozen=True)
class ExpertLoadSummary:
    """A run's expert load from the reference engine's step records: how evenly the router
    spread each step's tokens over the experts. max / mean = 1 is perfectly even; a busy
    expert bounds a grouped-expert step, so the ratio is the MoE layers' lost parallelism."""

    num_steps: int  # engine steps that ran the model
    tokens_max: float  # the busiest expert's tokens in a step (of any layer), mean over steps
    tokens_mean: float  # tokens per expert in a step (tokens x k / E), mean over steps
    tokens_peak: int  # the busiest expert's tokens in the busiest step
    max_over_mean: float  # sum of the steps' max / sum of their mean: token-weighted imbalance


def summarize_expert_load(records: Sequence[StepRecord]) -> ExpertLoadSummary | None:
    """The expert load over a run's StepRecords; None for a dense model (no expert figures)."""
    loads = [
        (r.expert_tokens_max, r.expert_tokens_mean)
        for r in records
        if r.expert_tokens_max is not None and r.expert_tokens_mean is not None
    ]
    if not loads:
        return None
    maxes, means = [m for m, _ in loads], [m for _, m in loads]
    return ExpertLoadSummary(
        num_steps=len(loads),
        tokens_max=statistics.fmean(maxes),
        tokens_mean=statistics.fmean(means),
        tokens_peak=max(maxes),
        max_over_mean=sum(maxes) / sum(means) if sum(means) else 0.0,
    )


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls after two warm-ups: the least disturbed by other
    load."""
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(threads: int, size: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats)


def measure_onednn_flops(threads: int, size: int = 2048, repeats: int = 5) -> float | None:
    """FLOP/s of a size x size fp32 linear through oneDNN with its weight packed once (see
    engines.reference.model.linear); None without oneDNN."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    torch.set_num_threads(threads)
    x = torch.randn(size, size)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(size, size), None)
    seconds = _best_seconds(
        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats
    )
    return 2 * size**3 / seconds


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _pool_tokens(prompts: list[list[int]], max_tokens: list[int]) -> int:
    """KV slots for the whole workload in flight at once (both engines get the same)."""
    return sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True)) + 1024


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- modes (run inside the worker subprocess) ------------------------------------------------
def _run_reference(spec: dict) -> ModeResult:
    import asyncio

    # torch: the bench's other modes run without it
    from engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(
        spec["model"],
        num_threads=spec["threads"],
        max_batch_size=spec["max_batch_size"],
        max_num_tokens=spec["max_num_tokens"],
        kv_cache_tokens=_pool_tokens(spec["prompts"], spec["max_tokens"]),
        profile_dir=spec.get("profile_dir"),
        profile_steps=spec.get("profile_steps", 50),
    )
    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for p, m in zip(spec["prompts"], spec["max_tokens"], strict=True)
    ]

    async def run():
        start = time.monotonic()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return start, time.monotonic(), results

    try:
        start, end, results = asyncio.run(run())
        records = engine.drain_step_records()
    finally:
        engine.shutdown()
    bad = [
        r
        for r, m in zip(results, spec["max_tokens"], strict=True)
        if not r.ok or r.completion_tokens != m
    ]
    if bad:
        raise RuntimeError(
            f"{len(bad)} requests failed or stopped early, first: {bad[0].finish_reason} "
            f"{bad[0].error or ''}"
        )
    flops_time, flops_tokens, steps = 0.0, 0, 0
    for rec in records:
        if not rec.prefill_tokens and len(rec.decode_tokens) >= _DECODE_BATCH_FOR_FLOPS:
            flops_time += rec.end - rec.start
            flops_tokens += len(rec.decode_tokens)
            steps += 1
    useful = sum(r.completion_tokens for r in results)
    expert_load = summarize_expert_load(records)
    profile = None
    if engine.profile_trace is not None:
        profile = asdict(read_phase_table(engine.profile_trace))
    return ModeResult.measured(
        "reference",
        useful,
        end - start,
        [r.metrics.first_token_time - start for r in results],
        engine.info.load_seconds,
        decode_flops_per_s=(2 * spec["matmul_params"] * flops_tokens / flops_time)
        if flops_time
        else None,
        decode_steps_counted=steps,
        profile=profile,
        expert_load=asdict(expert_load) if expert_load else None,
    )


def _load_hf(model: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def _run_hf_static(spec: dict) -> ModeResult:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    loaded = time.perf_counter()
    model = _load_hf(spec["model"])
    model.generation_config.eos_token_id = None  # run every row to max_new_tokens
    load_s = time.perf_counter() - loaded
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    size = spec["static_batch_size"]

    class FirstCall(LogitsProcessor):
        """Notes when the first token of the batch is being chosen (prefill done)."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    ttft: list[float] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(prompts), size):
            batch = prompts[lo : lo + size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.int64)
            mask = torch.zeros(len(batch), width, dtype=torch.int64)
            for i, p in enumerate(batch):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            first = FirstCall()
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(max_tokens[lo : lo + size]),
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([first]),
            )
            ttft += [first.at - start] * len(batch)
    seconds = time.perf_counter() - start
    useful = sum(max_tokens)
    return ModeResult.measured("hf-static", useful, seconds, ttft, load_s)


def _run_hf_continuous(spec: dict) -> ModeResult:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    loaded = time.perf_counter()
    model = _load_hf(spec["model"])
    load_s = time.perf_counter() - loaded
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    gen = GenerationConfig(
        max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(max_tokens),
        num_requests=len(prompts),
    )
    # Same limits as the reference engine gets; left to itself the manager sizes its cache from
    # (GPU) memory hints, which on CPU means tens of GB and huge padded batches.
    block_size = 32
    cb = ContinuousBatchingConfig(
        block_size=block_size,
        num_blocks=_pool_tokens(prompts, max_tokens) // block_size + len(prompts),
        max_batch_tokens=spec["max_num_tokens"],
        max_requests_per_batch=spec["max_batch_size"],
    )
    results = {}
    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gen,
            continuous_batching_config=cb,
            block=True,
            timeout=60,
            warmup=False,
            workload_hints=hints,
        ) as manager,
    ):
        start = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            manager.add_request(
                p, request_id=f"r{i}", max_new_tokens=m, record_timestamps=True, eos_token_id=-1
            )
        while len(results) < len(prompts):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if out.error:
                raise RuntimeError(f"transformers request {out.request_id}: {out.error}")
            if out.is_finished():
                results[out.request_id] = out
        seconds = time.perf_counter() - start
    useful = sum(len(r.generated_tokens) for r in results.values())
    ttft = [r.timestamps[0] - start for r in results.values() if r.timestamps]
    return ModeResult.measured("hf-continuous", useful, seconds, ttft, load_s)


def _run_vllm(spec: dict) -> ModeResult:
    """The workload through engine.kind vllm: every request at once, as for `reference`."""
    import asyncio

    requests = [
        GenerationRequest(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for p, m in zip(spec["prompts"], spec["max_tokens"], strict=True)
    ]

    async def run():
        # Loaded inside the loop: vLLM's engine binds to the loop it first runs on.
        engine = load_engine(
            "vllm",
            model=spec["model"],
            max_batch_size=spec["max_batch_size"],
            max_num_tokens=spec["max_num_tokens"],
            # vLLM also wants room for one request of the model's whole context.
            kv_cache_tokens=max(
                _pool_tokens(spec["prompts"], spec["max_tokens"]), spec["context_len"] + 512
            ),
            enforce_eager=spec["vllm_eager"],
        )
        try:
            start = time.monotonic()
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            return engine.info.load_seconds, start, time.monotonic(), results
        finally:
            engine.shutdown()

    load_s, start, end, results = asyncio.run(run())
    bad = [r for r, m in zip(results, spec["max_tokens"], strict=True) if r.completion_tokens != m]
    if bad:
        raise RuntimeError(f"{len(bad)} vLLM requests stopped early: {bad[0].finish_reason}")
    return ModeResult.measured(
        "vllm",
        sum(r.completion_tokens for r in results),
        end - start,
        [r.metrics.first_token_time - start for r in results],
        load_s,
    )


_RUNNERS = {
    "reference": _run_reference,
    "hf-static": _run_hf_static,
    "hf-continuous": _run_hf_continuous,
    "vllm": _run_vllm,
}


def _mode_command(mode: str, config: BenchConfig, threads: int) -> tuple[str, dict[str, str]]:
    """The interpreter a mode's worker runs under, and its extra environment."""
    if mode != "vllm":
        return sys.executable, {}
    python = config.vllm_python or (
        str(_VLLM_VENV_PYTHON) if _VLLM_VENV_PYTHON.exists() else sys.executable
    )
    # vLLM's CPU worker binds its OpenMP threads itself: give it the same cores as the others.
    return python, {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def _worker(mode: str, spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result = _RUNNERS[mode](spec)
    result.peak_rss_mb = _peak_rss_mb()
    Path(out_path).write_text(json.dumps(asdict(result)))


# ---- driver ----------------------------------------------------------------------------------
def run_bench(config: BenchConfig, log=print) -> BenchReport:
    """Build or find the model, measure the CPU, run each mode in a subprocess."""
    unknown = [m for m in config.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown bench mode(s) {unknown}; choose from {', '.join(MODES)}")
    model_dir = ensure_model(config)
    threads = config.threads or os.cpu_count() or 1
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts, max_tokens = make_workload(config, vocab)
    report = BenchReport(
        config=config,
        model=str(model_dir),
        threads=threads,
        matmul_params=matmul_params(model_dir),
        matmul_flops_per_s=measure_matmul_flops(threads),
        onednn_flops_per_s=measure_onednn_flops(threads),
    )
    onednn = report.onednn_flops_per_s
    log(
        f"model {model_dir} ({report.matmul_params / 1e6:.1f}M matmul params), "
        f"{len(prompts)} prompts, {sum(max_tokens)} useful tokens, {threads} threads, "
        f"matmul {report.matmul_flops_per_s / 1e9:.1f} GFLOP/s"
        + (f" (oneDNN {onednn / 1e9:.1f})" if onednn else "")
    )
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec = {
            "model": str(model_dir),
            "threads": threads,
            "prompts": prompts,
            "max_tokens": max_tokens,
            "static_batch_size": config.static_batch_size,
            "max_batch_size": config.max_batch_size,
            "max_num_tokens": config.max_num_tokens,
            "matmul_params": report.matmul_params,
            "vllm_eager": config.vllm_eager,
            "profile_dir": config.profile_dir,
            "profile_steps": config.profile_steps,
            "context_len": json.loads((model_dir / "config.json").read_text()).get(
                "max_position_embeddings", 2048
            ),
        }
        spec_path.write_text(json.dumps(spec))
        for round_, mode in ((i, m) for i in range(config.rounds) for m in config.modes):
            out_path = Path(tmp) / f"{mode}-{round_}.json"  # a failed round reads no earlier file
            python, extra_env = _mode_command(mode, config, threads)
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(threads),
                "TOKENIZERS_PARALLELISM": "false",
                **extra_env,
            }
            cmd = [python, "-m", "engines.dev.bench", "--worker", mode, spec_path, out_path]
            try:
                proc = subprocess.run(
                    [str(c) for c in cmd],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=config.mode_timeout_s,
                )
                if proc.returncode != 0 or not out_path.exists():
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    result = ModeResult(mode=mode, error=" | ".join(tail) or "worker failed")
                else:
                    result = ModeResult(**json.loads(out_path.read_text()))
            except subprocess.TimeoutExpired:
                result = ModeResult(mode=mode, error=f"timed out after {config.mode_timeout_s}s")
            result.round = round_
            report.results.append(result)
            prefix = f"round {round_ + 1}/{config.rounds}  " if config.rounds > 1 else ""
            log(prefix + format_result(result))
            if result.profile is not None:
                log(format_phase_table(PhaseTable(**result.profile)))
    return report


def format_result(r: ModeResult) -> str:
    if r.error:
        return f"{r.mode:14s} FAILED: {r.error}"
    ttft = (
        f"TTFT p50 {r.ttft_p50_s:.2f}s p95 {r.ttft_p95_s:.2f}s" if r.ttft_p50_s is not None else ""
    )
    line = (
        f"{r.mode:14s} {r.tokens_per_s:9.1f} tok/s  ({r.useful_tokens} tokens in "
        f"{r.seconds:.1f}s)  {ttft}  peak RSS {r.peak_rss_mb:.0f} MB"
    )
    return line + (f"\n{'':14s} {format_expert_load(r.expert_load)}" if r.expert_load else "")


def format_expert_load(load: dict) -> str:
    """One line from an ExpertLoadSummary dict (ModeResult.expert_load)."""
    return (
        f"expert load, tokens per expert per step: max {load['tokens_max']:.1f}, "
        f"mean {load['tokens_mean']:.1f} (max/mean {load['max_over_mean']:.2f}), "
        f"peak {load['tokens_peak']} over {load['num_steps']} steps"
    )


def _per_round(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return ""
    return f", median of {len(ratios)} rounds: " + ", ".join(f"{r:.2f}x" for r in ratios)


def format_summary(report: BenchReport) -> str:
    lines = []
    if report.speedup_vs_best_hf is not None:
        lines.append(
            f"reference vs best transformers mode: {report.speedup_vs_best_hf:.2f}x"
            + _per_round(report.ratios_vs_best_hf)
        )
    if report.speedup_vs_vllm is not None:
        vllm = report.result("vllm")
        ref = report.result("reference")
        lines.append(
            f"reference vs vllm: {report.speedup_vs_vllm:.2f}x "
            f"(start-up {ref.load_s:.1f}s vs {vllm.load_s:.1f}s)"
            + _per_round(report.ratios_vs_vllm)
        )
    ref = report.result("reference")
    if ref and report.decode_flops_per_s:
        lines.append(
            f"decode steps with batch >= {_DECODE_BATCH_FOR_FLOPS}: "
            f"{report.decode_flops_per_s / 1e9:.1f} GFLOP/s = "
            f"{100 * (report.decode_flops_fraction or 0):.0f}% of matmul "
            f"{report.matmul_flops_per_s / 1e9:.1f} GFLOP/s"
            + (
                f", {100 * report.decode_onednn_fraction:.0f}% of oneDNN's "
                f"{(report.onednn_flops_per_s or 0) / 1e9:.1f}"
                if report.decode_onednn_fraction
                else ""
            )
            + f" ({ref.decode_steps_counted} steps)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="bench worker (use `tokenmill bench`)")
    parser.add_argument("--worker", choices=MODES, required=True)
    parser.add_argument("spec")
    parser.add_argument("out")
    args = parser.parse_args()
    _worker(args.worker, args.spec, args.out)
