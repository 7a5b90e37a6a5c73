"""TensorRT-LLM engine adapter: a job's engine settings → TensorRT-LLM's LLM API, and its
RequestOutput → engines.api results.

Written against TensorRT-LLM 1.2 (the `LLM` API: PyTorch backend by default,
`tensorrt_llm._tensorrt_engine.LLM` for prebuilt TensorRT engines). `tensorrt_llm` is imported
only inside the constructor: it needs CUDA and MPI at import time. CPU tests run this module
against tests/standins/tensorrt_llm, a stand-in written to the same signatures and behaviours.

- The PyTorch backend does not quantize: it loads checkpoints already quantized by ModelOpt
  (`tokenmill quantize`). Before loading, the GPU is checked against the checkpoint's
  hf_quant_config.json (FP8 needs compute capability 8.9+, NVFP4 10.0+). The TensorRT backend
  can quantize while building; it calibrates on the project's own text (engine.extra
  `calibration`, the shape of a quantization spec's `calibration:`), written to a local
  dataset directory, never on TensorRT-LLM's default download (cnn_dailymail).
- In-flight batching is TensorRT-LLM's: every request goes straight to `generate_async`; the
  executor bounds the batch by max_batch_size, max_num_tokens and free KV blocks.
- Requests are checked by `engines.requests.admit` first (the check every engine kind shares):
  an empty prompt, an out-of-vocabulary id or a prompt that fills the context is a row error,
  and max_tokens is clipped to the context (finish_reason "length" there). Then the
  TensorRT-LLM-only check: a prompt longer than max_num_tokens without chunked prefill.
- Images (a vision-language checkpoint): each image's placeholder run collapsed back to one
  and the image file sent as a PIL image in `multi_modal_data`, which TensorRT-LLM's input
  processor expands and processes itself (engines/trtllm_images.py).
- Token accounting matches the reference engine. TensorRT-LLM removes a matched stop word
  (stop_token_ids entry or tokenized stop string) from token_ids unless
  include_stop_str_in_output, and its C++ decoder (TensorRT backend) never returns the end_id
  token; so requests go out with include_stop_str_in_output=True, the end_id is put back, a
  matched stop string is cut from the text here, and the checkpoint's other EOS ids (which
  TensorRT-LLM does not stop on: it knows one end_id) are sent as stop_token_ids and reported
  as EOS (stop_reason None).
- Sampling: TensorRT-LLM reads None as "runtime default" and the C++ samplers decode top_k 0
  with top_p 0 greedily, so sampled requests always carry explicit top_k (0 = off) and top_p
  (1.0 = off); greedy ones top_k=1.
- Seeds: the PyTorch backend of 1.2 samples every request from one generator seeded once
  (SamplingParams.seed is not read), so seeded sampled rows are not reproducible there. The
  adapter logs that once per engine and lists it in `limitations`; the TensorRT backend
  honours seeds.
- Penalties, logit bias, min_tokens, bad words and min_p: 1.2's default sampler ignores its
  own penalty fields, so a per-request logits processor applies them with the reference
  engine's code (engines/trtllm_logits.py). PyTorch backend only, without speculation, and
  min_tokens not with stop strings: anything else is refused before any work.
- A request that fails inside the executor (tensorrt_llm.executor.RequestError) is a row error;
  any other failure is the engine's.
- Structured output: the LLM is built with guided_decoding_backend "xgrammar" (the backend both
  TensorRT-LLM backends implement; llguidance is PyTorch-only), and a response_format becomes
  SamplingParams.guided_decoding (see `guided_decoding`; json_object is sent as the schema
  {"type": "object"}).
- Logprobs (PyTorch backend): TensorRT-LLM reads logprobs=0 as "off", so at least one is asked
  for; each position's {token id: Logprob(logprob, rank)} becomes a TokenLogprob with the k most
  likely alternatives. 1.2's TorchSampler returns the top k of log_softmax(logits) (after the
  logits processors, before temperature) and the sampled token only when it is among them. So
  on 1.2 a greedy row asks for its own k (its token is rank 1); a sampled row with top_k in
  1..SAMPLED_LOGPROBS_MAX_TOP_K (64) asks for max(k, top_k), which holds every token it can
  sample; any other sampled row asking for logprobs is refused before it runs
  (SAMPLED_LOGPROBS_UNSUPPORTED), rather than failing at random once a token from the tail is
  drawn. A position still without its token (a tie at the top-k edge, a grammar mask) is a row
  error naming it, never a made-up value. Versions whose SamplingParams has `logprobs_mode`
  always add the sampled token: there every row asks for its own k. The TensorRT backend
  computes logprobs from generation logits, which the LLM must gather for every request
  (gather_generation_logits): logprobs there are refused. prompt_logprobs are refused on both
  backends: 1.2 returns the top-k of each prompt position without the prompt token's own
  logprob.
- Timing comes from `request_perf_metrics` (return_perf_metrics=True on the LLM and on every
  SamplingParams): steady-clock time points as timedeltas, which on Linux share
  CLOCK_MONOTONIC with time.monotonic(); a time point never reached is zero, read as "never".
  There are no step records (info.has_step_records is False): cost is split over
  first_scheduled_time..finish_time intervals.

Throughput defaults (settings a job passes in engine.extra, beyond the shared EngineSpec
fields), from NVIDIA's published perf overview (docs/source/developer-guide/perf-overview.md:
trtllm-bench on the PyTorch backend with `cuda_graph_config: {enable_padding: true,
batch_sizes: [1 .. 8192]}`, often kv_cache_free_gpu_mem_fraction 0.95) and trtllm-bench's
sizing heuristic (max_batch_size = the requests that fit the KV cache, 64..4096; max_num_tokens
= max_batch_size x (1 + ISL/OSL), 2048..32768, i.e. 4096 / 8192 for 1k/1k on an H200):
- cuda_graphs True, cuda_graph_padding True (PyTorch backend: decode batches run as CUDA
  graphs, padded up to the next captured size rather than falling back to eager mode), with
  graphs captured only up to CUDA_GRAPH_MAX_BATCH (256) split among the actors sharing a GPU
  (`cuda_graph_batch_size`): each captured graph can take up to ~200 MB (TensorRT-LLM's docs)
  on top of the KV cache's memory fraction, and above a few hundred rows a decode step is
  long enough that launching it eagerly costs little;
- max_batch_size 2048 and max_num_tokens 8192 (TensorRT-LLM's own LLM defaults and
  trtllm-bench's fallback), used when a job leaves engine.max_batch_size / max_num_tokens null
  (the spec's default);
- scheduler_policy guaranteed_no_evict (TensorRT-LLM's default, also what the perf overview
  ran); max_utilization admits more requests when max_tokens is large, at the price of
  pausing some.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines import gpu
from engines.adapter import (
    VendorAdapter,
    check_settings,
    declared_settings,
    finish_reasons,
    finished_delta,
    import_vendor,
    same_clock,
    time_point,
    untimed_metrics,
)
from engines.api import (
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    ResponseFormat,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)
from engines.lora.peft import AdapterError
from engines.lora.prefix import AdapterPrefix
from engines.lora.vendor import AdapterTable, LoraLimits
from engines.parallel import engine_devices
from engines.quantize.calibration import load_texts
from engines.quantize.config import CalibrationSpec, QualitySpec, QuantizeError
from engines.reference.runtime.resources import load_tokenizer
from engines.reference.sampling.grammar import choice_grammar
from engines.requests import (
    admit,
    bad_words_token_ids,
    context_length,
    eos_token_ids,
    error_result,
    read_config,
)
from engines.settings import default
from engines.speculative import resolve
from engines.trtllm_args import PARALLEL_ARGS, accepted
from engines.trtllm_images import VisionTokens
from engines.trtllm_logits import SamplingProcessor, needs_processor, processing_fields

log = logging.getLogger(__name__)

TRTLLM_VERSION = "1.2"
INSTALL_HINT = "pip install 'tokenmill[trtllm]' (from NVIDIA's package index, on a CUDA machine)"
BACKENDS = ("pytorch", "tensorrt")
SCHEDULER_POLICIES = {
    "guaranteed_no_evict": "GUARANTEED_NO_EVICT",
    "max_utilization": "MAX_UTILIZATION",
}
DTYPES = ("auto", "float16", "bfloat16", "float32")
_FINISH_REASONS = finish_reasons(cancelled="cancelled")
# Timestamps further apart than this from our own clock are on another clock base: shift them.
_CLOCK_SKEW_S = 5.0
# json_object as a schema: any JSON object (the reference engine compiles the same one).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# The guided decoding backend both TensorRT-LLM backends implement (llguidance: PyTorch only).
GUIDED_DECODING_BACKEND = "xgrammar"
LOGPROBS_TENSORRT_UNSUPPORTED = (
    "logprobs need engine.extra.backend pytorch on engine.kind trtllm (the TensorRT backend "
    "computes them from generation logits gathered for every request); use backend pytorch, "
    "or engine.kind reference or vllm"
)
PROMPT_LOGPROBS_UNSUPPORTED = (
    "prompt_logprobs are not supported on engine.kind trtllm: TensorRT-LLM 1.2 returns the "
    "top-k at each prompt position, not the prompt token's own logprob; use engine.kind "
    "reference or vllm"
)
PROCESSING_TENSORRT_UNSUPPORTED = (
    "{names} need engine.extra.backend pytorch on engine.kind trtllm (they are applied by a "
    "per-request logits processor, which the TensorRT backend does not run per request); use "
    "backend pytorch, or engine.kind reference or vllm"
)
PROCESSING_SPECULATIVE_UNSUPPORTED = (
    "{names} cannot be combined with engine.speculative on engine.kind trtllm (a logits "
    "processor sees one position per step, not the proposals a speculative step verifies); "
    "turn speculation off, or use engine.kind reference or vllm"
)
# The largest top_k whose sampled rows get logprobs on 1.2 (asked for as their k): every
# token such a row can draw is among them. Each asked logprob is a Logprob object per output
# token pickled back from the executor, so the bound keeps that traffic small.
SAMPLED_LOGPROBS_MAX_TOP_K = 64
SAMPLED_LOGPROBS_UNSUPPORTED = (
    "logprobs of a sampled row on this TensorRT-LLM need top_k between 1 and "
    f"{SAMPLED_LOGPROBS_MAX_TOP_K} (its sampler returns the k most likely tokens, with the "
    "sampled one only when it is among them); set top_k, send temperature 0, or use "
    "engine.kind reference or vllm"
)
SAMPLING_SPECULATIVE_UNSUPPORTED = (
    "sampled rows (temperature, top_p or top_k) under engine.speculative eagle3 or mtp need a "
    "TensorRT-LLM with allow_advanced_sampling (this one would decode them greedily); send "
    "temperature 0, turn speculation off, or use method ngram or draft"
)
MIN_TOKENS_STOP_UNSUPPORTED = (
    "min_tokens with stop strings is not supported on engine.kind trtllm (TensorRT-LLM matches "
    "stop strings from the first token); send one of them, or use engine.kind reference or vllm"
)
SEED_LIMITATION = (
    "TensorRT-LLM 1.2's PyTorch backend ignores per-request seeds (its sampler draws every "
    "request from one generator): seeded sampled rows are not reproducible; use backend "
    "tensorrt or the reference engine where reproducibility matters"
)
# Parallelism and multi-node orchestration: passed to the LLM as they are (engines/trtllm_args.py
# says where the names were read). The sizes must multiply to resources.devices_per_actor
# (engines.parallel, checked when the spec is parsed).
PARALLEL_SETTINGS = tuple(PARALLEL_ARGS)
# The largest decode batch captured as a CUDA graph when a job does not say, shared among the
# engines on one GPU. Graphs pay where launching a step's kernels is a large share of it (small
# batches); TensorRT-LLM's docs put each graph at up to CUDA_GRAPH_MB of extra memory, and 1.2
# captures ~20 sizes up to 256 with padding (23 up to its own default batch of 2,048, the
# largest of them the most costly).
CUDA_GRAPH_MAX_BATCH = 256
CUDA_GRAPH_MB = 200


@dataclass(frozen=True)
class _StopRules:
    """What a request stops on, as sent to TensorRT-LLM and as the reference engine reports it."""

    strings: tuple[str, ...]  # stop strings (cut from the text)
    token_ids: tuple[int, ...]  # the request's own stop token ids (reported as stop_reason)
    eos_ids: frozenset[int]  # EOS ids sent as stop_token_ids (reported as EOS: None)
    keep_end_id: bool  # put back the end_id token TensorRT-LLM left out

    @property
    def max_string_len(self) -> int:
        return max((len(s) for s in self.strings), default=0)


class TrtllmEngine(VendorAdapter):
    """engines.api.Engine over a TensorRT-LLM `LLM` (one per engine actor)."""

    vendor = "TensorRT-LLM"

    def __init__(
        self,
        model: str,
        *,
        max_batch_size: int = default("trtllm", "max_batch_size"),
        max_num_tokens: int = default("trtllm", "max_num_tokens"),
        kv_cache_tokens: int | None = None,
        kv_cache_memory_fraction: float = default("trtllm", "kv_cache_memory_fraction"),
        kv_cache_dtype: str = default("trtllm", "kv_cache_dtype"),
        enable_prefix_caching: bool = default("trtllm", "enable_prefix_caching"),
        enable_chunked_prefill: bool = default("trtllm", "enable_chunked_prefill"),
        dtype: str = default("trtllm", "dtype"),
        max_model_len: int | None = None,
        scheduler_policy: str = default("trtllm", "scheduler_policy"),
        backend: str = "pytorch",
        cuda_graphs: bool = True,
        cuda_graph_max_batch_size: int | None = None,
        cuda_graph_padding: bool = True,
        actors_per_device: int = 1,
        build_cache: str | None = None,
        build_cache_dir: str = "~/.cache/tokenmill/trtllm-build",
        quantize: str | None = None,
        calibration: dict[str, Any] | None = None,
        check_gpu: bool = True,
        speculative: Any = None,
        lora_adapters: Mapping[str, str] | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
        lora_prefix: Mapping[str, Any] | None = None,
        **more: Any,
    ) -> None:
        """Settings beyond the shared EngineSpec fields (pass them in engine.extra):

        lora_adapters, max_loras, max_lora_rank, max_cpu_loras: LoRA adapters by name (local
            PEFT folders) and their limits, with the reference engine's defaults: the LLM API's
            lora_config (LoraConfig of tensorrt_llm.lora_helper, every adapter folder in
            lora_dir) and a LoRARequest (tensorrt_llm.executor) per request. PyTorch backend
            only (the TensorRT backend builds LoRA into the engine).
        lora_prefix: {uri, cache_dir, endpoint_url, region, anonymous}: adapters not in
            lora_adapters are looked up as uri/NAME on first use (engines/lora/prefix.py) and
            sent with their folder in the LoRARequest.

        backend: pytorch (loads HF / ModelOpt checkpoints) | tensorrt (builds a TensorRT engine).
        cuda_graphs: pytorch backend: capture decode steps as CUDA graphs (default on).
        cuda_graph_max_batch_size: largest captured batch (at most max_batch_size); null:
            CUDA_GRAPH_MAX_BATCH (256) / actors_per_device, at most max_batch_size.
        cuda_graph_padding: pad a batch up to the next captured size instead of running it
            eagerly (default on, as in NVIDIA's published benchmark configs).
        actors_per_device: engines sharing this GPU (set from resources.devices_per_actor or
            the Serve replica's devices below 1; pipeline.engine_setup): their CUDA graphs
            share its memory.
        build_cache: tensorrt backend: keep built engines under this local path or s3:// /
            other fsspec URI (synced to build_cache_dir before loading, back after a build).
        quantize: tensorrt backend only: fp8 | nvfp4 quantization while building (ModelOpt
            runs inside TensorRT-LLM); the PyTorch backend needs a pre-quantized checkpoint.
        calibration: with quantize: the calibration text, as a quantization spec's
            `calibration:` section (source, column, num_samples, max_length, batch_size,
            seed); null: the built-in text sample. Never a download.
        PARALLEL_SETTINGS (tensor_parallel_size, pipeline_parallel_size, context_parallel_size,
            moe_*_parallel_size, enable_attention_dp, gpus_per_node, orchestrator_type, ...):
            TensorRT-LLM's own, passed to the LLM unchanged; null or absent: its defaults. The
            engine spans tensor x pipeline x context parallel GPUs (engines.parallel). Inside
            a multi-device engine actor the default MPI orchestrator starts its ranks on the
            actor's node, over the GPUs the actor's placement group holds there.
        check_gpu: check the GPU's compute capability against the checkpoint first.
        speculative: engine.speculative as a dict (engines.speculative); becomes the LLM API's
            speculative_config (see `speculative_config`). PyTorch backend only.
        """
        check_settings("TrtllmEngine", more, SETTINGS)
        parallel = {k: v for k, v in more.items() if v is not None}
        num_devices = engine_devices("trtllm", parallel)
        _check_settings(backend, scheduler_policy, dtype, kv_cache_dtype, quantize, build_cache)

        spec = resolve("trtllm", speculative)
        if spec is not None and backend != "pytorch":
            raise EngineError(
                "engine.speculative needs TensorRT-LLM's pytorch backend (its decoding configs "
                "do not apply to backend tensorrt)"
            )
        self._adapters: AdapterTable | None = None
        lora: LoraLimits | None = None
        prefix = AdapterPrefix.of(lora_prefix)
        if lora_adapters or prefix is not None:
            if backend != "pytorch":
                raise EngineError(
                    "model.adapters (LoRA) needs TensorRT-LLM's pytorch backend: the tensorrt "
                    "backend builds adapters into the engine at build time"
                )
            lora = LoraLimits.of(max_loras, max_lora_rank, max_cpu_loras)
            self._adapters = AdapterTable(lora_adapters or {}, lora.max_lora_rank, prefix)
        if calibration is not None and quantize is None:
            raise EngineError("engine.extra.calibration applies with engine.extra.quantize only")
        started = time.monotonic()
        model_dir = Path(model)
        config = read_config(model_dir)
        self._vocab_size = _vocab_size(config, model_dir)
        self._max_num_tokens = max_num_tokens
        self._chunked_prefill = enable_chunked_prefill
        self._max_model_len = max_model_len or context_length(config)
        self._eos_ids = eos_token_ids(config, model_dir)
        # A vision-language checkpoint: requests may carry images (engines/trtllm_images.py).
        self._vision = VisionTokens.read(model_dir)
        self._backend = backend
        self._model_dir = model_dir
        self._speculative = spec is not None
        self._greedy_speculation = False  # set below: this version would ignore sampling
        self._tokenizer: Any = None  # the checkpoint's own, for bad_words (loaded on first use)
        self.limitations: tuple[str, ...] = (SEED_LIMITATION,) if backend == "pytorch" else ()
        self._seed_warned = False
        if check_gpu:
            self._device_name = str(_check_gpu(model_dir, kv_cache_dtype, quantize))
        else:
            self._device_name = "unchecked"
        trt = import_vendor(
            "tensorrt_llm",
            kind="trtllm",
            product="TensorRT-LLM",
            version=TRTLLM_VERSION,
            hint=INSTALL_HINT,
        )
        from tensorrt_llm.executor import RequestError
        from tensorrt_llm.llmapi import (
            CapacitySchedulerPolicy,
            GuidedDecodingParams,
            KvCacheConfig,
            SchedulerConfig,
        )

        self._sampling_cls = trt.SamplingParams
        # Versions whose SamplingParams has logprobs_mode always return the sampled token's
        # logprob with the top k; 1.2's may leave it out.
        self._sampled_logprob_included = has_field(trt.SamplingParams, "logprobs_mode")
        self._guided_cls = GuidedDecodingParams
        self._request_error: type[Exception] = RequestError
        kv_cache_config = KvCacheConfig(
            enable_block_reuse=enable_prefix_caching,
            free_gpu_memory_fraction=kv_cache_memory_fraction,
            max_tokens=kv_cache_tokens,
            # The TensorRT backend takes the KV format from the checkpoint / QuantConfig.
            dtype="fp8" if kv_cache_dtype == "fp8" and backend == "pytorch" else "auto",
        )
        args: dict[str, Any] = dict(
            dtype=dtype,
            **parallel,
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
            guided_decoding_backend=GUIDED_DECODING_BACKEND,
        )
        self._build_cache = build_cache
        self._build_cache_local = None
        # Quantizing calibrates on the project's text (the built-in sample unless given).
        with _calibration((calibration or {}) if quantize else None) as calib:
            if backend == "tensorrt":
                llm_cls, extra = self._tensorrt_args(
                    quantize, kv_cache_dtype, build_cache, build_cache_dir, calib, args
                )
                args.update(extra)
            else:
                llm_cls = trt.LLM
                args["cuda_graph_config"] = _cuda_graph_config(
                    cuda_graphs,
                    cuda_graph_batch_size(
                        max_batch_size, cuda_graph_max_batch_size, actors_per_device
                    ),
                    cuda_graph_padding,
                )
                if lora is not None and self._adapters is not None:
                    from tensorrt_llm.lora_helper import LoraConfig

                    args["lora_config"] = LoraConfig(
                        lora_dir=[str((lora_adapters or {})[n]) for n in self._adapters.names],
                        max_lora_rank=lora.max_lora_rank,
                        max_loras=lora.max_loras,
                        max_cpu_loras=lora.max_cpu_loras,
                    )
                if spec is not None:
                    args["speculative_config"] = speculative_config(spec)
                    self._greedy_speculation = samples_greedily(args["speculative_config"])
                    # The drafters need the previous step's tokens before they propose: the
                    # overlap scheduler (which runs a step ahead) is off with them, as
                    # TensorRT-LLM's examples set it.
                    args["disable_overlap_scheduler"] = True
            # Only what this backend's LLM takes (the real one raises on the rest, by name).
            wrong = sorted(set(args) - set(accepted(backend)))
            if wrong:
                raise EngineError(f"TensorRT-LLM's {backend} backend takes no {', '.join(wrong)}")
            with self._loading(model):
                self._llm = llm_cls(str(model_dir), **args)
        if self._build_cache_local is not None:
            _sync_tree(self._build_cache_local, build_cache, upload=True)
        self._init_bookkeeping()  # self._live: request_id -> its RequestOutput in flight
        self.info = EngineInfo(
            kind="trtllm",
            model=model,
            max_model_len=self._max_model_len,
            device="cuda:0",
            num_devices=num_devices,
            dtype=dtype,
            has_step_records=False,
            eos_token_ids=self._eos_ids,
            load_seconds=time.monotonic() - started,
            limitations=self.limitations,
        )

    def _tensorrt_args(self, quantize, kv_cache_dtype, build_cache, build_cache_dir, calib, args):
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
            extra["calib_config"] = CalibConfig(**calib)
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

    def _admit(self, request: GenerationRequest) -> tuple[str | None, int]:
        """(why the request cannot run, its output budget): the shared checks, then ours."""
        admission = admit(
            request,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            takes_adapters=self._adapters is not None,
            takes_images=self._vision is not None,
        )
        if not admission.ok:
            return admission.error, 0
        if request.images and self._vision is not None:
            try:
                self._vision.check(request)
            except ValueError as exc:
                return str(exc), 0
        if request.adapter is not None and self._adapters is not None:
            try:
                self._adapters.get(request.adapter)  # known, and its config fits
            except AdapterError as exc:
                return str(exc), 0
        if request.sampling.prompt_logprobs is not None:
            return PROMPT_LOGPROBS_UNSUPPORTED, 0
        if request.sampling.logprobs is not None and self._backend != "pytorch":
            return LOGPROBS_TENSORRT_UNSUPPORTED, 0
        if not self._sampled_logprob_reachable(request.sampling):
            return SAMPLED_LOGPROBS_UNSUPPORTED, 0
        problem = self._processing_problem(request.sampling)
        if problem is not None:
            return problem, 0
        if self._greedy_speculation and not request.sampling.is_greedy:
            return SAMPLING_SPECULATIVE_UNSUPPORTED, 0
        num_prompt = len(request.prompt_token_ids)
        if not self._chunked_prefill and num_prompt > self._max_num_tokens:
            return (
                f"prompt ({num_prompt} tokens) exceeds engine.max_num_tokens "
                f"({self._max_num_tokens}) and chunked prefill is off; enable "
                "engine.enable_chunked_prefill or raise max_num_tokens"
            ), 0
        return None, admission.max_tokens

    def _processing_problem(self, s: SamplingParams) -> str | None:
        """Why this kind cannot apply the request's penalties, bias, min_tokens, bad words or
        min_p (engines/trtllm_logits.py applies them on the PyTorch backend); None: it can."""
        if not needs_processor(s):
            return None
        names = ", ".join(processing_fields(s))
        if self._backend != "pytorch":
            return PROCESSING_TENSORRT_UNSUPPORTED.format(names=names)
        if self._speculative:
            return PROCESSING_SPECULATIVE_UNSUPPORTED.format(names=names)
        if s.min_tokens and s.stop:
            return MIN_TOKENS_STOP_UNSUPPORTED
        if s.bad_words and self._bad_words_tokenizer() is None:
            return "bad_words need a tokenizer, and the model directory has none"
        return None

    def _bad_words_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (the one the reference engine tokenizes bad words with)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model_dir) or False
        return self._tokenizer or None

    def _processor(self, request: GenerationRequest) -> list[Any] | None:
        """The request's logits processor list (PyTorch backend), None when it needs none."""
        s = request.sampling
        if not needs_processor(s):
            return None
        bad_words: list[list[int]] = []
        if s.bad_words:
            bad_words = bad_words_token_ids(self._bad_words_tokenizer(), s.bad_words)
        return [
            SamplingProcessor(
                s,
                len(request.prompt_token_ids),
                self._eos_ids,
                tuple(tuple(w) for w in bad_words),
            )
        ]

    def _stop_rules(self, request: GenerationRequest) -> _StopRules:
        s = request.sampling
        own = tuple(s.stop_token_ids)
        # TensorRT-LLM stops on one end_id (the tokenizer's EOS); the checkpoint may list more
        # (generation_config.json), which the reference engine stops on too.
        eos = () if s.ignore_eos else tuple(t for t in self._eos_ids if t not in own)
        return _StopRules(
            strings=tuple(s.stop),
            token_ids=own,
            eos_ids=frozenset(eos),
            keep_end_id=self._backend == "tensorrt" and not s.ignore_eos,
        )

    def _sampling(self, request: GenerationRequest, max_tokens: int, rules: _StopRules) -> Any:
        s = request.sampling
        greedy = s.is_greedy
        if not greedy and s.seed is not None:
            self._note_seed()
        stop_ids = [*rules.token_ids, *sorted(rules.eos_ids)]
        return self._sampling_cls(
            max_tokens=max_tokens,  # TensorRT-LLM's default is 32: always set it
            # top_k=1 is greedy in every TensorRT-LLM sampler, whatever temperature says. A
            # sampled request spells out "no top-k / top-p" (0 / 1.0): None would mean the C++
            # runtime defaults, top_k 0 and top_p 0, which those samplers decode greedily.
            temperature=None if greedy else s.temperature,
            top_p=None if greedy else s.top_p,
            top_k=1 if greedy else s.top_k,
            seed=s.seed,
            stop=list(rules.strings) or None,
            stop_token_ids=stop_ids or None,
            # Keep matched stop ids in token_ids (the reference engine counts them); the stop
            # string is cut from the text in _account.
            include_stop_str_in_output=True,
            ignore_eos=s.ignore_eos,
            detokenize=True,
            return_perf_metrics=True,
            guided_decoding=guided_decoding(s.response_format, self._guided_cls),
            logprobs=self._logprobs_asked(s),
            # Penalties, logit bias, min_tokens, bad words and min_p: see trtllm_logits.py
            # (1.2's own fields for them are ignored by its default sampler).
            logits_processor=self._processor(request),
        )

    def _sampled_logprob_reachable(self, s: SamplingParams) -> bool:
        """Whether every token this row can emit comes back with its logprob (module notes):
        always without logprobs, for greedy rows and where the version adds the sampled token;
        on 1.2 for sampled rows only when their top_k bounds what they can draw."""
        if s.logprobs is None or s.is_greedy or self._sampled_logprob_included:
            return True
        return 0 < s.top_k <= SAMPLED_LOGPROBS_MAX_TOP_K

    def _logprobs_asked(self, s: SamplingParams) -> int | None:
        """How many logprobs per position to ask TensorRT-LLM for: at least one (it reads 0
        as "off"), and on 1.2 a sampled row's top_k, so its token is among them."""
        if s.logprobs is None:
            return None
        if s.is_greedy or self._sampled_logprob_included:
            return max(s.logprobs, 1)
        return max(s.logprobs, s.top_k)

    def _note_seed(self) -> None:
        """Say once per engine that the PyTorch backend will not honour per-request seeds."""
        if self._backend != "pytorch" or self._seed_warned:
            return
        self._seed_warned = True
        log.warning("%s", SEED_LIMITATION)

    def _submit(self, request: GenerationRequest, max_tokens: int, streaming: bool):
        self._check_alive()
        rules = self._stop_rules(request)
        params = self._sampling(request, max_tokens, rules)
        inputs: Any = list(request.prompt_token_ids)
        if request.images and self._vision is not None:
            inputs = self._vision.inputs(request)  # checked by _admit
        try:
            out = self._llm.generate_async(
                inputs,
                sampling_params=params,
                streaming=streaming,
                **self._lora_request(request.adapter),
            )
        except ValueError:
            raise  # TensorRT-LLM's per-request input checks: the caller's row error
        except self._request_error as exc:
            raise ValueError(str(exc)) from exc
        except Exception as exc:  # a shut-down or broken executor
            raise self._mark_dead(exc) from exc
        self._live[request.request_id] = out
        # generate_async filled params.end_id from the tokenizer when it was None.
        return out, _Accounting(request, rules, params)

    def _lora_request(self, name: str | None) -> dict[str, Any]:
        """generate_async's lora_request for adapter `name` (checked by _admit); none for
        the base model, so an engine without adapters sends exactly what it did before."""
        if name is None or self._adapters is None:
            return {}
        from tensorrt_llm.executor import LoRARequest

        adapter = self._adapters.get(name)
        return {"lora_request": LoRARequest(adapter.name, adapter.int_id, adapter.path)}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        arrival = time.monotonic()
        problem, max_tokens = self._admit(request)
        if problem is not None:
            return error_result(request, problem, arrival)
        try:
            out, accounting = self._submit(request, max_tokens, streaming=False)
        except ValueError as exc:  # TensorRT-LLM's per-request input checks
            return error_result(request, str(exc), arrival)
        try:
            out = await out
        except asyncio.CancelledError:
            out.abort()
            raise
        except Exception as exc:
            return self._failed(request, exc, arrival)
        finally:
            self._live.pop(request.request_id, None)
        self._num_finished += 1
        return accounting.result(out, arrival)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        arrival = time.monotonic()
        problem, max_tokens = self._admit(request)
        if problem is not None:
            yield finished_delta(error_result(request, problem, arrival))
            return
        try:
            out, accounting = self._submit(request, max_tokens, streaming=True)
        except ValueError as exc:
            yield finished_delta(error_result(request, str(exc), arrival))
            return
        sent_ids, sent_text = 0, 0
        finished = False
        try:
            async for update in out:
                if update.finished:
                    finished = True
                    self._num_finished += 1
                    result = accounting.result(update, arrival)
                    ids = result.output_token_ids[sent_ids:]
                    text = result.text[sent_text:]
                    yield StreamDelta(
                        token_ids=ids,
                        text=text,
                        finished=True,
                        result=result,
                        logprobs=None if result.logprobs is None else result.logprobs[sent_ids:],
                    )
                    return
                completion = update.outputs[0]
                ids = list(completion.token_ids[sent_ids:])
                logprobs = accounting.logprobs(ids, completion, sent_ids)
                safe = accounting.stable_text_len(completion.text or "")
                text = (completion.text or "")[sent_text:safe]
                sent_ids, sent_text = len(completion.token_ids), max(sent_text, safe)
                if ids or text:
                    yield StreamDelta(token_ids=ids, text=text, logprobs=logprobs)
        except Exception as exc:  # GeneratorExit / CancelledError are not Exceptions
            finished = True
            yield finished_delta(self._failed(request, exc, arrival))
        finally:
            # Closed early (client gone): free the request's KV blocks.
            if not finished:
                out.abort()
            self._live.pop(request.request_id, None)

    # --- failures and shutdown (the skeleton is engines.adapter's) ---------------------------

    def _row_error(self, exc: Exception) -> str | None:
        """A failure of this request alone is a row error. Any other error from the executor
        has shut the LLM down (TensorRT-LLM does so on a background error): the engine is
        dead from here on (VendorAdapter._engine_failure)."""
        if isinstance(exc, (self._request_error, ValueError)):
            return f"TensorRT-LLM failed the request: {exc}"
        return None

    def stats(self) -> EngineStats:
        """The engine's load; raises EngineDeadError once the executor is known dead."""
        self._raise_if_dead()
        return EngineStats(
            num_running=len(self._live),
            num_waiting=0,  # TensorRT-LLM's queue is not visible through the LLM API
            num_finished=self._num_finished,
            num_preemptions=0,
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_steps=0,
        )


# The settings this kind takes: the constructor's keyword parameters, and the parallel ones
# its **more passes to the LLM.
SETTINGS = declared_settings(TrtllmEngine.__init__, *PARALLEL_SETTINGS)


# --- mapping ---------------------------------------------------------------------------------


def speculative_config(spec: Any) -> Any:
    """engines.speculative.SpeculativeConfig → TensorRT-LLM 1.2's decoding config object
    (tensorrt_llm.llmapi: NGramDecodingConfig, DraftTargetDecodingConfig,
    Eagle3DecodingConfig, MTPDecodingConfig). disable_above_batch_size is max_concurrency
    (speculation off above that many requests); null leaves speculation always on."""
    from tensorrt_llm.llmapi import (
        DraftTargetDecodingConfig,
        Eagle3DecodingConfig,
        MTPDecodingConfig,
        NGramDecodingConfig,
    )

    common: dict[str, Any] = {}
    if spec.disable_above_batch_size is not None:
        common["max_concurrency"] = spec.disable_above_batch_size
    if spec.method == "ngram":
        return NGramDecodingConfig(
            max_draft_len=spec.num_tokens,
            max_matching_ngram_size=spec.prompt_lookup_max,
            # Each request looks up its own prompt + output (as the reference engine does),
            # not a pool shared by all requests.
            is_public_pool=False,
            **common,
        )
    if spec.method == "draft":
        return DraftTargetDecodingConfig(
            max_draft_len=spec.num_tokens, speculative_model=spec.model, **common
        )
    # Eagle-3 and MTP run one-model paths by default, where TensorRT-LLM 1.2 decodes every
    # request greedily unless allow_advanced_sampling is set (temperature, top_p and top_k
    # then apply; the drafts stay greedy, and acceptance is an exact match with the target's
    # own sample, so the output keeps the model's distribution).
    if spec.method == "eagle3":
        cls = Eagle3DecodingConfig
        args = {"max_draft_len": spec.num_tokens, "speculative_model": spec.model}
    else:
        cls = MTPDecodingConfig
        args = {"num_nextn_predict_layers": spec.num_layers or spec.num_tokens}
    if has_field(cls, "allow_advanced_sampling"):
        args["allow_advanced_sampling"] = True
    return cls(**args, **common)


def has_field(cls: Any, name: str) -> bool:
    """Whether a TensorRT-LLM config class (pydantic, or a dataclass in the stand-in) has the
    field `name` in this version."""
    fields = getattr(cls, "model_fields", None) or getattr(cls, "__dataclass_fields__", {})
    return name in fields


def samples_greedily(config: Any) -> bool:
    """Whether TensorRT-LLM decodes every request greedily under this speculative config: a
    one-model Eagle-3 or MTP path in a version without allow_advanced_sampling (or with it
    off)."""
    one_model = getattr(config, "eagle3_one_model", None) or getattr(
        config, "mtp_eagle_one_model", None
    )
    return bool(one_model) and not getattr(config, "allow_advanced_sampling", False)


def guided_decoding(fmt: ResponseFormat | None, params_cls: Any) -> Any:
    """TensorRT-LLM's GuidedDecodingParams for a response format; None for free text.

    json_schema → json (the schema text); json_object → json with the schema {"type":
    "object"}, not json_object=True, whose guide (xgrammar's built-in JSON grammar) admits any
    JSON value, arrays and numbers too; regex → regex. choice →
    an EBNF grammar whose sentences are the choices (the reference engine's, JSON-quoted),
    not a regex alternation: EBNF string quoting is exact for any text, while escaping a
    choice for xgrammar's regex dialect (not Python's re) would be a second syntax to get
    right."""
    if fmt is None:
        return None
    if fmt.kind == "json_schema":
        return params_cls(json=fmt.schema)
    if fmt.kind == "json_object":
        return params_cls(json=JSON_OBJECT_SCHEMA)
    if fmt.kind == "regex":
        return params_cls(regex=fmt.regex)

    return params_cls(grammar=choice_grammar(fmt.choices))


class _MissingLogprob(ValueError):
    """TensorRT-LLM returned no logprob for a token the request asked one for (a row error)."""


def _token_logprob(token: int, entry: Any, k: int, position: int) -> TokenLogprob:
    """One position of CompletionOutput.logprobs → TokenLogprob.

    The entry is {token id: Logprob(logprob, rank)} (TokenLogprobs): the top-k and, where
    TensorRT-LLM adds it, the chosen token; alternatives are the k most likely, highest first.
    A plain float (the list[float] form) is the chosen token's logprob with no alternatives."""
    if isinstance(entry, (int, float)):
        return TokenLogprob(token, float(entry), ())
    chosen = entry.get(token)
    if chosen is None:
        raise _MissingLogprob(
            f"TensorRT-LLM returned no logprob for output token {position} (id {token}, outside "
            f"the {len(entry)} most likely it returned: a tie at the top_k edge, or a "
            "response_format mask); send the row with temperature 0, or use engine.kind "
            "reference or vllm"
        )
    ranked = sorted(((-float(lp.logprob), t) for t, lp in entry.items()))[:k]
    return TokenLogprob(token, float(chosen.logprob), tuple((t, -v) for v, t in ranked))


def _spec_counts(perf: Any) -> dict[str, int]:
    """Per-request draft and accepted token counts from request_perf_metrics, when reported."""
    stats = getattr(perf, "speculative_decoding", None)
    if stats is None:
        return {}
    return {
        "spec_proposed_tokens": int(getattr(stats, "total_draft_tokens", 0) or 0),
        "spec_accepted_tokens": int(getattr(stats, "total_accepted_draft_tokens", 0) or 0),
    }


class _Accounting:
    """One request's TensorRT-LLM output → the reference engine's accounting."""

    def __init__(self, request: GenerationRequest, rules: _StopRules, params: Any) -> None:
        self.request = request
        self.rules = rules
        self.params = params

    def stable_text_len(self, text: str) -> int:
        """How much of a streamed text no later stop-string match can cut."""
        cut, _ = _cut_at_stop(text, self.rules.strings)
        return max(0, min(len(cut), len(text) - max(0, self.rules.max_string_len - 1)))

    def logprobs(
        self, ids: list[int], completion: Any, start: int = 0
    ) -> list[TokenLogprob] | None:
        """TokenLogprobs of `ids` (the completion's tokens from `start` on), when asked for.
        _MissingLogprob (a ValueError: a row error) when TensorRT-LLM left one out."""
        k = self.request.sampling.logprobs
        if k is None:
            return None
        entries = list(completion.logprobs or [])[start : start + len(ids)]
        if len(entries) < len(ids):
            raise _MissingLogprob(
                f"TensorRT-LLM returned {start + len(entries)} logprobs for "
                f"{start + len(ids)} output tokens"
            )
        pairs = enumerate(zip(ids, entries, strict=True))
        return [_token_logprob(t, e, k, start + i) for i, (t, e) in pairs]

    def result(self, out: Any, arrival: float) -> GenerationResult:
        request = self.request
        completion = out.outputs[0]
        ids, text, reason, stop_reason = self._account(completion)
        error = None
        logprobs = None
        try:
            logprobs = self.logprobs(ids, completion)
        except _MissingLogprob as exc:
            error, reason = str(exc), "error"
        if reason is None:
            error = (
                "request timed out in TensorRT-LLM"
                if completion.finish_reason == "timeout"
                else f"unexpected finish_reason {completion.finish_reason!r} from TensorRT-LLM"
            )
            reason = "error"
        return GenerationResult(
            request_id=request.request_id,
            output_token_ids=ids,
            text=text,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(ids),
            cached_prompt_tokens=int(getattr(out, "cached_tokens", 0) or 0),
            error=error,
            stop_reason=stop_reason if reason == "stop" else None,
            metrics=_metrics(getattr(completion, "request_perf_metrics", None), arrival, ids),
            logprobs=logprobs,
            **_spec_counts(getattr(completion, "request_perf_metrics", None)),
        )

    def _account(self, completion: Any) -> tuple[list[int], str, str | None, str | int | None]:
        rules = self.rules
        ids = list(completion.token_ids)
        reason = _FINISH_REASONS.get(completion.finish_reason)
        stop_reason = completion.stop_reason
        end_id = getattr(self.params, "end_id", None)
        if reason == "stop" and stop_reason is None and rules.keep_end_id and end_id is not None:
            ids.append(end_id)  # the C++ decoder does not return the end_id it stopped on
        if reason == "length" and ids and ids[-1] in (*rules.token_ids, *rules.eos_ids):
            # TensorRT-LLM checks length before stop words; the reference engine the reverse.
            reason, stop_reason = "stop", ids[-1]
        if isinstance(stop_reason, int) and stop_reason in rules.eos_ids:
            stop_reason = None  # an EOS id we added: the reference engine reports EOS as None
        text, matched = _cut_at_stop(completion.text or "", rules.strings)
        if matched is not None:
            reason, stop_reason = "stop", matched
        elif isinstance(stop_reason, str):
            stop_reason = None  # TensorRT-LLM matched a stop string we no longer see
        return ids, text, reason, stop_reason


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The text before its earliest stop string, and that string (as the reference engine)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


def _metrics(perf: Any, arrival: float, ids: list[int]) -> RequestMetrics:
    """TensorRT-LLM's timing metrics (timedeltas on the steady clock, zero = never) →
    monotonic seconds."""
    now = time.monotonic()
    timing = getattr(perf, "timing_metrics", None)
    their_arrival = time_point(getattr(timing, "arrival_time", None))
    if their_arrival is None:
        return untimed_metrics(arrival, now, bool(ids))
    # Same clock (Linux steady_clock == CLOCK_MONOTONIC): use as is. Otherwise anchor their
    # arrival on ours and keep their intervals.
    offset = 0.0 if same_clock(their_arrival, arrival, _CLOCK_SKEW_S) else arrival - their_arrival

    def shifted(td: Any) -> float | None:
        value = time_point(td)
        return None if value is None else value + offset

    first_scheduled = shifted(timing.first_scheduled_time)
    first_token = shifted(timing.first_token_time) if ids else None
    if ids and first_scheduled is None:
        first_scheduled = first_token  # tokens came, so it was scheduled by then
    finish = shifted(timing.last_token_time) or now
    return RequestMetrics(
        arrival_time=their_arrival + offset,
        first_scheduled_time=first_scheduled,
        first_token_time=first_token,
        finish_time=max(finish, first_token or finish, first_scheduled or finish),
    )


# --- setup helpers ---------------------------------------------------------------------------


def _check_settings(
    backend: str,
    scheduler_policy: str,
    dtype: str,
    kv_cache_dtype: str,
    quantize: str | None,
    build_cache: str | None,
) -> None:
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


def _vocab_size(config: dict[str, Any], model_dir: Path) -> int:
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise EngineError(f"{model_dir}/config.json has no vocab_size")
    return vocab


def cuda_graph_batch_size(max_batch_size: int, asked: int | None, actors_per_device: int) -> int:
    """The largest decode batch to capture as a CUDA graph: the job's own
    cuda_graph_max_batch_size, or CUDA_GRAPH_MAX_BATCH shared among the engines on one GPU;
    never above max_batch_size (larger graphs would never run)."""
    if asked is not None:
        if not 1 <= asked <= max_batch_size:
            raise EngineError(
                f"engine.extra cuda_graph_max_batch_size {asked} must be between 1 and "
                f"engine.max_batch_size ({max_batch_size}); lower it, or set cuda_graphs false"
            )
        return asked
    if actors_per_device < 1:
        raise EngineError(f"actors_per_device {actors_per_device} must be at least 1")
    return max(1, min(max_batch_size, CUDA_GRAPH_MAX_BATCH // actors_per_device))


def _cuda_graph_config(enabled: bool, max_batch_size: int, padding: bool) -> Any:
    """CudaGraphConfig for the PyTorch backend, or None (which turns CUDA graphs off). The
    library generates the captured sizes up to max_batch_size; they are logged with the memory
    they may take, since they come on top of the KV cache's share of the GPU."""
    if not enabled:
        return None
    from tensorrt_llm.llmapi import CudaGraphConfig

    config = CudaGraphConfig(max_batch_size=max_batch_size, enable_padding=padding)
    sizes = list(getattr(config, "batch_sizes", None) or [])
    if sizes:
        log.info(
            "TensorRT-LLM captures %d CUDA graphs for decode batches up to %d (up to ~%d MB "
            "by its docs)",
            len(sizes),
            max(sizes),
            len(sizes) * CUDA_GRAPH_MB,
        )
    return config


@contextmanager
def _calibration(calibration: dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
    """CalibConfig arguments naming a local dataset directory ("train" split, "text" column)
    that holds the calibration text, for as long as the build runs; None when not quantizing.

    TensorRT-LLM's CalibConfig defaults to downloading cnn_dailymail from the Hugging Face
    Hub, which an air-gapped cluster cannot; a local directory is its other accepted form."""
    if calibration is None:
        yield None
        return
    spec, texts = _calibration_texts(calibration)
    with tempfile.TemporaryDirectory(prefix="tokenmill-trt-calibration-") as tmp:
        root = Path(tmp) / "calibration"
        root.mkdir()
        lines = (json.dumps({"text": t}) for t in texts)
        (root / "train.jsonl").write_text("\n".join(lines) + "\n")
        yield dict(
            calib_dataset=str(root),
            calib_batches=max(1, math.ceil(len(texts) / spec.batch_size)),
            calib_batch_size=spec.batch_size,
            calib_max_seq_length=spec.max_length,
            random_seed=spec.seed,
        )


def _calibration_texts(calibration: dict[str, Any]) -> tuple[Any, list[str]]:
    """engine.extra.calibration (a quantization spec's `calibration:` section) → its texts,
    drawn as `tokenmill quantize` draws them (engines.quantize.calibration)."""
    from pydantic import ValidationError

    try:
        spec = CalibrationSpec(**calibration)
        return spec, load_texts(spec, QualitySpec()).calibration
    except (ValidationError, TypeError) as exc:
        raise EngineError(f"engine.extra.calibration is not valid: {exc}") from exc
    except QuantizeError as exc:
        raise EngineError(str(exc)) from exc


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineError(f"engine {name} {value!r} is not supported; choose one of {allowed}")


def _check_gpu(model_dir: Path, kv_cache_dtype: str, quantize: str | None) -> Any:

    if quantize is None:
        return gpu.check_quantization_support(model_dir, kv_cache_dtype)
    # Quantized while building: the build's formats are what the GPU must run.
    wanted = gpu.CheckpointQuantization(
        quantize.upper(), "FP8" if kv_cache_dtype == "fp8" else None
    )
    return gpu.check_capability(wanted, f"{model_dir} (quantize: {quantize})")


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
