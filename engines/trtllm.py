"""TensorRT-LLM engine adapter: a job's engine settings → TensorRT-LLM's LLM API, and its
RequestOutput → engines.api results.

Written against TensorRT-LLM 1.2 (the `LLM` API: PyTorch backend by default,
`tensorrt_llm._tensorrt_engine.LLM` for prebuilt TensorRT engines). `tensorrt_llm` is imported
only inside the constructor: it needs CUDA and MPI at import time. CPU tests run this module
against tests/standins/tensorrt_llm, a stand-in written to the same signatures.

- The PyTorch backend does not quantize: it loads checkpoints already quantized by ModelOpt
  (`tokenmill quantize`). Before loading, the GPU is checked against the checkpoint's
  hf_quant_config.json (FP8 needs compute capability 8.9+, NVFP4 10.0+).
- In-flight batching is TensorRT-LLM's: every request goes straight to `generate_async`; the
  executor bounds the batch by max_batch_size, max_num_tokens and free KV blocks.
- Per-request problems are results, not exceptions: a prompt longer than max_num_tokens
  without chunked prefill (TensorRT-LLM raises for those) or longer than max_model_len is
  checked before submission and returned with finish_reason "error".
- Timing comes from `request_perf_metrics` (return_perf_metrics=True on the LLM and on every
  SamplingParams): steady-clock time points as timedeltas, which on Linux share
  CLOCK_MONOTONIC with time.monotonic(). There are no step records (info.has_step_records is
  False): cost is split over first_scheduled_time..finish_time intervals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engines.api import (
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    StepRecord,
    StreamDelta,
)

log = logging.getLogger(__name__)

TRTLLM_VERSION = "1.2"
INSTALL_HINT = "pip install 'tokenmill[trtllm]' (from NVIDIA's package index, on a CUDA machine)"
BACKENDS = ("pytorch", "tensorrt")
SCHEDULER_POLICIES = {
    "guaranteed_no_evict": "GUARANTEED_NO_EVICT",
    "max_utilization": "MAX_UTILIZATION",
}
DTYPES = ("auto", "float16", "bfloat16", "float32")
_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "cancelled"}
# Timestamps further apart than this from our own clock are on another clock base: shift them.
_CLOCK_SKEW_S = 5.0
SETTINGS = (
    "max_batch_size",
    "max_num_tokens",
    "kv_cache_tokens",
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "dtype",
    "max_model_len",
    "scheduler_policy",
    "backend",
    "build_cache",
    "build_cache_dir",
    "quantize",
    "tensor_parallel_size",
    "check_gpu",
)


class TrtllmEngine:
    """engines.api.Engine over a TensorRT-LLM `LLM` (one per engine actor)."""

    def __init__(
        self,
        model: str,
        *,
        max_batch_size: int = 64,
        max_num_tokens: int = 2048,
        kv_cache_tokens: int | None = None,
        kv_cache_memory_fraction: float = 0.9,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        dtype: str = "auto",
        max_model_len: int | None = None,
        scheduler_policy: str = "guaranteed_no_evict",
        backend: str = "pytorch",
        build_cache: str | None = None,
        build_cache_dir: str = "~/.cache/tokenmill/trtllm-build",
        quantize: str | None = None,
        tensor_parallel_size: int = 1,
        check_gpu: bool = True,
        **unknown: Any,
    ) -> None:
        """Settings beyond the shared EngineSpec fields (pass them in engine.extra):

        backend: pytorch (loads HF / ModelOpt checkpoints) | tensorrt (builds a TensorRT engine).
        build_cache: tensorrt backend: keep built engines under this local path or s3:// /
            other fsspec URI (synced to build_cache_dir before loading, back after a build).
        quantize: tensorrt backend only: fp8 | nvfp4 quantization while building (ModelOpt
            runs inside TensorRT-LLM); the PyTorch backend needs a pre-quantized checkpoint.
        tensor_parallel_size: GPUs this engine spans.
        check_gpu: check the GPU's compute capability against the checkpoint first.
        """
        if unknown:
            raise TypeError(
                f"TrtllmEngine got unknown setting(s) {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(SETTINGS)}"
            )
        _check_choice("backend", backend, BACKENDS)
        _check_choice("scheduler_policy", scheduler_policy, tuple(SCHEDULER_POLICIES))
        _check_choice("dtype", dtype, DTYPES)
        _check_choice("kv_cache_dtype", kv_cache_dtype, ("auto", "fp8"))
        if quantize is not None:
            _check_choice("quantize", quantize, ("fp8", "nvfp4"))
            if backend != "tensorrt":
                raise EngineError(
                    "engine.extra.quantize needs backend: tensorrt (the PyTorch backend loads "
                    "pre-quantized checkpoints: build one with `tokenmill quantize`)"
                )
        if build_cache is not None and backend != "tensorrt":
            raise EngineError("engine.extra.build_cache applies to backend: tensorrt only")
        started = time.monotonic()
        model_dir = Path(model)
        self._max_num_tokens = max_num_tokens
        self._chunked_prefill = enable_chunked_prefill
        self._max_model_len = max_model_len or _context_length(model_dir)
        if check_gpu:
            self._device_name = str(_check_gpu(model_dir, kv_cache_dtype, quantize))
        else:
            self._device_name = "unchecked"
        trt = _import_tensorrt_llm()
        from tensorrt_llm.llmapi import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig

        self._sampling_cls = trt.SamplingParams
        kv_cache_config = KvCacheConfig(
            enable_block_reuse=enable_prefix_caching,
            free_gpu_memory_fraction=kv_cache_memory_fraction,
            max_tokens=kv_cache_tokens,
            # The TensorRT backend takes the KV format from the checkpoint / QuantConfig.
            dtype="fp8" if kv_cache_dtype == "fp8" and backend == "pytorch" else "auto",
        )
        args: dict[str, Any] = dict(
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_config=kv_cache_config,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduler_config=SchedulerConfig(
                capacity_scheduler_policy=getattr(
                    CapacitySchedulerPolicy, SCHEDULER_POLICIES[scheduler_policy]
                )
            ),
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_input_len=self._max_model_len,
            max_seq_len=self._max_model_len,
            return_perf_metrics=True,
        )
        self._build_cache = build_cache
        self._build_cache_local = None
        if backend == "tensorrt":
            llm_cls, extra = self._tensorrt_args(
                quantize, kv_cache_dtype, build_cache, build_cache_dir, args
            )
            args.update(extra)
        else:
            llm_cls = trt.LLM
        try:
            self._llm = llm_cls(str(model_dir), **args)
        except (ValueError, TypeError) as exc:
            raise EngineError(
                f"TensorRT-LLM rejected the engine settings for {model}: {exc}"
            ) from exc
        if self._build_cache_local is not None:
            _sync_tree(self._build_cache_local, build_cache, upload=True)
        self._live: dict[str, Any] = {}  # request_id -> RequestOutput in flight
        self._num_finished = 0
        self._closed = False
        self.info = EngineInfo(
            kind="trtllm",
            model=model,
            max_model_len=self._max_model_len,
            device="cuda:0",
            num_devices=tensor_parallel_size,
            dtype=dtype,
            has_step_records=False,
            eos_token_ids=_eos_token_ids(model_dir),
            load_seconds=time.monotonic() - started,
        )

    def _tensorrt_args(self, quantize, kv_cache_dtype, build_cache, build_cache_dir, args):
        from tensorrt_llm._tensorrt_engine import LLM as TensorrtEngineLLM
        from tensorrt_llm.llmapi import (
            BuildCacheConfig,
            BuildConfig,
            CalibConfig,
            QuantAlgo,
            QuantConfig,
        )

        extra: dict[str, Any] = {
            "build_config": BuildConfig(
                max_input_len=args.pop("max_input_len"),
                max_seq_len=args.pop("max_seq_len"),
                max_batch_size=args.pop("max_batch_size"),
                max_num_tokens=args.pop("max_num_tokens"),
            )
        }
        if quantize is not None:
            extra["quant_config"] = QuantConfig(
                quant_algo=getattr(QuantAlgo, quantize.upper()),
                kv_cache_quant_algo=QuantAlgo.FP8 if kv_cache_dtype == "fp8" else None,
            )
            extra["calib_config"] = CalibConfig()
        if build_cache is not None:
            local = Path(os.path.expanduser(build_cache_dir))
            if "://" in build_cache and not build_cache.startswith("file://"):
                _sync_tree(local, build_cache, upload=False)
                self._build_cache_local = local
            else:
                local = Path(os.path.expanduser(build_cache.removeprefix("file://")))
            extra["enable_build_cache"] = BuildCacheConfig(cache_root=local)
        return TensorrtEngineLLM, extra

    # --- requests ---------------------------------------------------------------------------

    def _check_request(self, request: GenerationRequest) -> str | None:
        """Why the request cannot run (a row error), or None."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            return "empty prompt: at least one prompt token is needed"
        total = num_prompt + request.sampling.max_tokens
        if total > self._max_model_len:
            return (
                f"prompt ({num_prompt} tokens) + max_tokens ({request.sampling.max_tokens}) = "
                f"{total} exceeds max_model_len {self._max_model_len}; shorten the prompt or "
                "lower max_tokens"
            )
        if not self._chunked_prefill and num_prompt > self._max_num_tokens:
            return (
                f"prompt ({num_prompt} tokens) exceeds engine.max_num_tokens "
                f"({self._max_num_tokens}) and chunked prefill is off; enable "
                "engine.enable_chunked_prefill or raise max_num_tokens"
            )
        return None

    def _sampling(self, request: GenerationRequest) -> Any:
        s = request.sampling
        greedy = s.is_greedy
        return self._sampling_cls(
            max_tokens=s.max_tokens,  # TensorRT-LLM's default is 32: always set it
            # top_k=1 is greedy in every TensorRT-LLM sampler, whatever temperature says.
            temperature=None if greedy else s.temperature,
            top_p=None if greedy or s.top_p == 1.0 else s.top_p,
            top_k=1 if greedy else (s.top_k or None),
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            detokenize=True,
            return_perf_metrics=True,
        )

    def _submit(self, request: GenerationRequest, streaming: bool) -> Any:
        if self._closed:
            raise EngineDeadError("the TensorRT-LLM engine is shut down")
        out = self._llm.generate_async(
            list(request.prompt_token_ids),
            sampling_params=self._sampling(request),
            streaming=streaming,
        )
        self._live[request.request_id] = out
        return out

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        arrival = time.monotonic()
        problem = self._check_request(request)
        if problem is not None:
            return _error_result(request, problem, arrival)
        try:
            out = self._submit(request, streaming=False)
        except ValueError as exc:  # TensorRT-LLM's per-request input checks
            return _error_result(request, str(exc), arrival)
        try:
            out = await out
        except asyncio.CancelledError:
            out.abort()
            raise
        except ValueError as exc:
            return _error_result(request, str(exc), arrival)
        except Exception as exc:
            raise self._engine_error(exc) from exc
        finally:
            self._live.pop(request.request_id, None)
        self._num_finished += 1
        return _to_result(request, out, arrival)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        arrival = time.monotonic()
        problem = self._check_request(request)
        if problem is not None:
            result = _error_result(request, problem, arrival)
            yield StreamDelta(token_ids=[], text="", finished=True, result=result)
            return
        try:
            out = self._submit(request, streaming=True)
        except ValueError as exc:
            result = _error_result(request, str(exc), arrival)
            yield StreamDelta(token_ids=[], text="", finished=True, result=result)
            return
        sent_ids, sent_text = 0, 0
        finished = False
        try:
            async for update in out:
                completion = update.outputs[0]
                ids = list(completion.token_ids[sent_ids:])
                text = completion.text[sent_text:]
                sent_ids, sent_text = len(completion.token_ids), len(completion.text)
                if update.finished:
                    finished = True
                    self._num_finished += 1
                    result = _to_result(request, update, arrival)
                    yield StreamDelta(token_ids=ids, text=text, finished=True, result=result)
                    return
                if ids or text:
                    yield StreamDelta(token_ids=ids, text=text)
        except ValueError as exc:
            finished = True
            yield StreamDelta(
                token_ids=[],
                text="",
                finished=True,
                result=_error_result(request, str(exc), arrival),
            )
        except Exception as exc:  # GeneratorExit / CancelledError are not Exceptions
            raise self._engine_error(exc) from exc
        finally:
            # Closed early (client gone): free the request's KV blocks.
            if not finished:
                out.abort()
            self._live.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        out = self._live.get(request_id)
        if out is not None:
            out.abort()

    def drain_step_records(self) -> list[StepRecord]:
        return []  # TensorRT-LLM reports per-request timing only

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._live),
            num_waiting=0,  # TensorRT-LLM's queue is not visible through the LLM API
            num_finished=self._num_finished,
            num_preemptions=0,
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_steps=0,
        )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for out in list(self._live.values()):
            out.abort()
        self._llm.shutdown()

    def _engine_error(self, exc: Exception) -> EngineError:
        if self._closed:
            return EngineDeadError(f"the TensorRT-LLM engine is shut down: {exc}")
        return EngineError(f"TensorRT-LLM failed: {type(exc).__name__}: {exc}")


# --- mapping ---------------------------------------------------------------------------------


def _to_result(request: GenerationRequest, out: Any, arrival: float) -> GenerationResult:
    completion = out.outputs[0]
    reason = _FINISH_REASONS.get(completion.finish_reason)
    error = None
    if reason is None:
        error = (
            "request timed out in TensorRT-LLM"
            if completion.finish_reason == "timeout"
            else f"unexpected finish_reason {completion.finish_reason!r} from TensorRT-LLM"
        )
        reason = "error"
    return GenerationResult(
        request_id=request.request_id,
        output_token_ids=list(completion.token_ids),
        text=completion.text or "",
        finish_reason=reason,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=len(completion.token_ids),
        cached_prompt_tokens=int(getattr(out, "cached_tokens", 0) or 0),
        error=error,
        stop_reason=completion.stop_reason,
        metrics=_metrics(getattr(completion, "request_perf_metrics", None), arrival),
    )


def _metrics(perf: Any, arrival: float) -> RequestMetrics:
    """TensorRT-LLM's timing metrics (timedeltas on the steady clock) → monotonic seconds."""
    now = time.monotonic()
    timing = getattr(perf, "timing_metrics", None)
    if timing is None or timing.arrival_time is None:
        return RequestMetrics(arrival_time=arrival, first_scheduled_time=arrival, finish_time=now)
    their_arrival = timing.arrival_time.total_seconds()
    # Same clock (Linux steady_clock == CLOCK_MONOTONIC): use as is. Otherwise anchor their
    # arrival on ours and keep their intervals.
    offset = 0.0 if abs(their_arrival - arrival) < _CLOCK_SKEW_S else arrival - their_arrival

    def seconds(td: Any) -> float | None:
        return None if td is None else td.total_seconds() + offset

    first_scheduled = seconds(timing.first_scheduled_time)
    first_token = seconds(timing.first_token_time)
    finish = seconds(timing.last_token_time) or now
    return RequestMetrics(
        arrival_time=their_arrival + offset,
        first_scheduled_time=first_scheduled,
        first_token_time=first_token,
        finish_time=max(finish, first_token or finish),
    )


def _error_result(request: GenerationRequest, message: str, arrival: float) -> GenerationResult:
    return GenerationResult.without_output(
        request,
        "error",
        error=message,
        metrics=RequestMetrics(arrival_time=arrival, finish_time=time.monotonic()),
    )


# --- setup helpers ---------------------------------------------------------------------------


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineError(f"engine {name} {value!r} is not supported; choose one of {allowed}")


def _import_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise EngineError(
            f"engine.kind trtllm needs TensorRT-LLM {TRTLLM_VERSION}.x, which is not installed "
            f"({exc}); {INSTALL_HINT}"
        ) from exc
    return tensorrt_llm


def _check_gpu(model_dir: Path, kv_cache_dtype: str, quantize: str | None) -> Any:
    from engines import gpu

    if quantize is None:
        return gpu.check_quantization_support(model_dir, kv_cache_dtype)
    # Quantized while building: the build's formats are what the GPU must run.
    wanted = gpu.CheckpointQuantization(
        quantize.upper(), "FP8" if kv_cache_dtype == "fp8" else None
    )
    return gpu.check_capability(wanted, f"{model_dir} (quantize: {quantize})")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON: {exc}") from exc


def _context_length(model_dir: Path) -> int:
    config = _read_json(model_dir / "config.json")
    if not config:
        raise EngineError(f"{model_dir}: no config.json; point model.path at a HF checkpoint")
    return int(config.get("max_position_embeddings") or 2048)


def _eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def _sync_tree(local: Path, remote: str, *, upload: bool) -> None:
    """Copy the TensorRT build cache between `local` and an fsspec URI (engines reuse builds
    across nodes: a missing remote is an empty cache, not an error)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(remote)
    local.mkdir(parents=True, exist_ok=True)
    if upload:
        fs.put(str(local) + "/", path.rstrip("/") + "/", recursive=True)
    elif fs.exists(path):
        fs.get(path.rstrip("/") + "/", str(local) + "/", recursive=True)
