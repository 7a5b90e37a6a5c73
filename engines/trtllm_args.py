"""The arguments TensorRT-LLM 1.2's `LLM` takes, per backend: one table for the adapter
(engines/trtllm.py builds only these, and passes a job's parallel settings through) and for
the CPU stand-in (tests/standins/tensorrt_llm accepts exactly these, so an argument the real
library would refuse fails in the tests too).

Read from tensorrt_llm/llmapi/llm_args.py of NVIDIA/TensorRT-LLM's main line between December
2025 and February 2026 (it has `pp_partition`, added for 1.2, and not yet the 1.3 changes),
the closest revision to the v1.2.1 tag whose own files could not be read here (docs/engines.md,
TensorRT-LLM). There, `BaseLlmArgs` forbids unknown arguments, and the arguments of the
TensorRT backend (`TrtLlmArgs`) raise on the PyTorch backend's `LLM` ("The following arguments
are specific to TensorRT backend and cannot be used with PyTorch backend"). The KV cache's
dtype is `KvCacheConfig.dtype`, not an argument of its own.
"""

from __future__ import annotations

from typing import Any

# How one engine spans devices and nodes (`BaseLlmArgs`), with their defaults; a job passes
# them in engine.extra unchanged (engines.parallel checks their product).
PARALLEL_ARGS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "gpus_per_node": None,
    "moe_cluster_parallel_size": None,
    "moe_tensor_parallel_size": None,
    "moe_expert_parallel_size": None,
    "enable_attention_dp": False,
    "enable_lm_head_tp_in_adp": False,
    "cp_config": None,
    "orchestrator_type": None,
    "pp_partition": None,  # layers per pipeline stage (prototype)
}
# Both backends (`BaseLlmArgs`, and the constructor's named ones).
COMMON_ARGS: dict[str, Any] = {
    "model": None,
    "tokenizer": None,
    "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "trust_remote_code": False,
    "dtype": "auto",
    "revision": None,
    "tokenizer_revision": None,
    **PARALLEL_ARGS,
    "load_format": "auto",
    "enable_lora": False,
    "lora_config": None,
    "kv_cache_config": None,
    "enable_chunked_prefill": False,
    "guided_decoding_backend": None,
    "scheduler_config": None,
    "speculative_config": None,
    "max_batch_size": 2048,
    "max_input_len": 1024,
    "max_seq_len": None,
    "max_beam_width": 1,
    "max_num_tokens": 8192,
    "return_perf_metrics": False,
    "postprocess_tokenizer_dir": None,
    "reasoning_parser": None,
}
# The PyTorch backend's own (`TorchLlmArgs`).
PYTORCH_ONLY_ARGS: dict[str, Any] = {
    "cuda_graph_config": None,
    "disable_overlap_scheduler": False,
    "enable_iter_perf_stats": False,
    "stream_interval": 1,
    "attn_backend": "TRTLLM",
    "torch_compile_config": None,
}
# The TensorRT backend's own (`TrtLlmArgs`): they raise on the PyTorch backend.
TENSORRT_ONLY_ARGS: dict[str, Any] = {
    "quant_config": None,
    "calib_config": None,
    "build_config": None,
    "enable_build_cache": False,
    "embedding_parallel_mode": "SHARDING_ALONG_VOCAB",
    "fast_build": False,
    "batching_type": None,
    "normalize_log_probs": False,
}


def accepted(backend: str) -> dict[str, Any]:
    """The arguments the `LLM` of `backend` (pytorch | tensorrt) takes, with defaults."""
    own = PYTORCH_ONLY_ARGS if backend == "pytorch" else TENSORRT_ONLY_ARGS
    return {**COMMON_ARGS, **own}


def refused(backend: str) -> dict[str, Any]:
    """The other backend's own arguments, which the `LLM` of `backend` refuses by name."""
    return TENSORRT_ONLY_ARGS if backend == "pytorch" else PYTORCH_ONLY_ARGS
