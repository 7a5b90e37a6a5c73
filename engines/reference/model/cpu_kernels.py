"""The reference engine's CPU kernels (engines/reference/kernels/*.cpp), built on first use,
and the switch back to plain torch ops.

- paged_attention.cpp: every chunk of a step (decode tokens, verifications, prefill chunks)
  attended over the paged KV cache in place, one call per layer; with GPT-OSS's attention
  sinks and sliding window where a layer has them.
- moe_fused.cpp: a Qwen3-MoE layer after its router in one call (fp32): routing, grouping,
  the experts' SwiGLU over weights laid out for its micro-kernels, the weighted combine.
- moe_experts.cpp: the other MoE layers' experts side by side over the threads.
- panel_linear.cpp: an fp32 linear over a weight laid out for the micro-kernel the fused MoE
  layer uses too (panel.h); the LM head takes it (engines.reference.model.linear.PanelLinear).
- fused_ops.cpp: RMSNorm (with the residual add before it), rotary embedding (with the K/V
  cache write) and SiLU * up, one pass each instead of 3-8 torch ops (each a pass over the
  activations and a dispatch).

Why the attention kernel: the torch path gathers every decode request's KV blocks into a padded
copy per layer before SDPA; for a step of 64 requests with ~330 tokens of context on the
`small` model that is ~170 MB copied per step, more than the step's matmuls move. The kernel
reads each K/V row where it lies, once for all query heads sharing it, and also beats SDPA on
prefill chunks (see paged_attention.cpp). It is compiled once per machine with the compiler torch
itself uses (about ten seconds) into ~/.cache/tokenmill/kernels/<key> (TOKENMILL_KERNEL_CACHE
overrides; the sources are compiled from a copy there, so wherever the package lives the
build is reused), keyed by the source, the torch version, the CPU's instruction-set flags (it is
built for the host CPU) and the torch install it links against (two environments on one node,
Serve's and the engine's, would otherwise take turns rebuilding one directory: the build files
name each one's include paths, and torch rebuilds when they change), and loaded from there
afterwards in well under a second; torch
serialises concurrent builds of one directory with a lock file. Where it cannot be built (no
C++ compiler) the engine says so once in its log and keeps the torch ops;
TOKENMILL_CPU_KERNELS=0 forces them. CUDA always uses the torch ops (the equality tests run
those on CPU too).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parents[1] / "kernels" / name
    for name in (
        "paged_attention.cpp",
        "fused_ops.cpp",
        "moe_experts.cpp",
        "moe_fused.cpp",
        "panel_linear.cpp",
        "lora.cpp",
    )
]
# Part of the build's key.
_HEADERS = [Path(__file__).parents[1] / "kernels" / name for name in ("fast_exp.h", "panel.h")]
DISABLE_ENV = "TOKENMILL_CPU_KERNELS"
CACHE_ENV = "TOKENMILL_KERNEL_CACHE"
# Reassociation lets the compiler vectorise the dot products and sums (fp32 results then
# differ from a sequential sum in the last bits, as any blocked kernel does); no -ffast-math:
# it would also assume no infinities. -fopenmp: at::parallel_for is a header template whose
# OpenMP pragma is dropped without it (the kernel then runs on one thread); the library it
# links, libgomp.so.1, resolves to the copy torch has already loaded (same soname), so the
# kernel shares torch's thread pool.
_CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# A build takes about ten seconds. torch's build lock is a file that a process killed mid-build
# leaves behind, and torch then waits on it forever; one older than this is removed.
_STALE_LOCK_S = 300.0
# (row, KV head) pairs below which a call runs on the calling thread: handing work to the
# OpenMP workers costs more than a few rows' attention.
PARALLEL_GRAIN = 16


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    key = hashlib.sha256()
    for part in [*(src.read_bytes() for src in _SOURCES + _HEADERS), torch.__version__.encode()]:
        key.update(part)
    key.update(_cpu_flags().encode())
    key.update(" ".join(_CFLAGS).encode())
    key.update(str(Path(torch.__file__).resolve().parent).encode())
    key.update(sys.version.encode())
    base = os.environ.get(CACHE_ENV) or "~/.cache/tokenmill/kernels"
    return Path(base).expanduser() / f"cpu-kernels-{key.hexdigest()[:16]}"


@functools.cache
def kernels_available() -> bool:
    """Build (first time on this machine) and load the kernels; False where they cannot be."""
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build / "lock")
        with _environment_ninja():
            load(
                name="tokenmill_cpu_kernels",
                sources=[str(src) for src in _staged_sources(build)],
                build_directory=str(build),
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, a failed build: the torch path still works
        logger.warning(
            "CPU kernels unavailable (%s: %s); the reference engine uses plain torch ops",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return False
    return True


@contextlib.contextmanager
def _environment_ninja() -> Iterator[None]:
    """This environment's ninja (the `ninja` package) first on PATH while torch builds: which
    ninja a process finds otherwise depends on its PATH, and two ninja versions (a system
    1.11 and the package's 1.13 write different build logs) each take the other's objects for
    stale and rebuild everything, every time the other has built."""
    try:
        import ninja  # optional: without the package, the system's ninja builds
    except ImportError:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _staged_sources(build: Path) -> list[Path]:
    """The sources (and the headers they include) copied into the build directory, compiled
    from there: the build files then name the same paths wherever the package lives, so a copy
    of it elsewhere (a Ray job's working_dir, another checkout) reuses the build instead of
    rebuilding it, as torch does whenever the source paths in its build file change. The
    directory is keyed by the sources' content, so a file there is written once."""
    staged = build / "src"
    staged.mkdir(exist_ok=True)
    for src in _SOURCES + _HEADERS:
        target = staged / src.name
        content = src.read_bytes()
        if target.is_file() and target.read_bytes() == content:
            continue
        partial = staged / f".{src.name}.{os.getpid()}"
        partial.write_bytes(content)
        os.replace(partial, target)  # atomic: a concurrent build reads the old or the new
    return [staged / src.name for src in _SOURCES]


def _remove_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            logger.warning("removed a stale CPU-kernel build lock %s", lock)
    except FileNotFoundError:
        pass


def use_kernels(device: torch.device) -> bool:
    """Whether tensors on `device` go through the kernels (looked up on this module at each
    call, so a test can switch the torch ops on)."""
    return device.type == "cpu" and kernels_available()


def paged_attention(
    out: torch.Tensor,  # [T, H, D], written at `rows`
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [R] int64 query rows of the flat batch
    req: torch.Tensor,  # [R] int32 each row's index into `tables`
    limit: torch.Tensor,  # [R] int32 keys each row attends to (its position + 1)
    tables: torch.Tensor,  # [N, max_blocks] int32 block tables of the step's chunks
    scale: float,
    sinks: torch.Tensor | None = None,  # [H] a sink logit per query head (GPT-OSS)
    window: int | None = None,  # a row at position p sees keys p - window + 1 .. p only
) -> None:
    """Causal attention of q[rows] over each row's paged context, written to out[rows]. With
    `sinks`, each head's softmax also counts its sink logit, which attends to nothing (a sink
    of -inf is none); with `window`, a row attends to its last `window` keys only."""
    torch.ops.tokenmill.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        rows,
        req,
        limit,
        tables,
        scale,
        PARALLEL_GRAIN,
        sinks,
        window or 0,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 statistics, transformers' rounding order)."""
    return torch.ops.tokenmill.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta in place (the residual stream), then RMSNorm of the sum."""
    return torch.ops.tokenmill.add_rms_norm(x, delta, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin as a new contiguous [T, H, D] tensor."""
    return torch.ops.tokenmill.rope(x, cos, sin)


def rope_cache(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D] the fused projection's output
    cos: torch.Tensor,  # [T, 1, D]
    sin: torch.Tensor,  # [T, 1, D]
    k_cache: torch.Tensor,  # [KVH, num_blocks, block_size, D], written at `slots`
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64 flat cache slot of each token
    heads: int,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # Qwen3: q, k weights, eps
) -> torch.Tensor:
    """q with RoPE ([T, H, D]); K with RoPE and V go straight into their cache slots. With
    `head_norms`, each q and k head is RMSNorm-ed first (Qwen3's q_norm / k_norm)."""
    q_norm, k_norm, eps = head_norms if head_norms is not None else (None, None, 0.0)
    return torch.ops.tokenmill.rope_cache(
        qkv, cos, sin, k_cache, v_cache, slots, heads, q_norm, k_norm, eps
    )


def lora_add(
    y: torch.Tensor,  # [T, out], added to in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, W, in] each slot's A
    b: torch.Tensor,  # [S, out, W] each slot's B (scaled)
    slots: torch.Tensor,  # [T] int64 each row's slot, -1: none
    widths: torch.Tensor,  # [S] int64 columns of W each slot uses
) -> None:
    """y[t] += B[s] A[s] x[t] for each row t of a slot s (kernels/lora.cpp)."""
    torch.ops.tokenmill.lora_add(y, x, a, b, slots, widths)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] ([T, 2I] -> [T, I])."""
    return torch.ops.tokenmill.silu_mul(gate_up)


def moe_experts(
    grouped: torch.Tensor,  # [P, hidden] the step's (token, expert) pairs, grouped by expert
    outputs: torch.Tensor,  # [P, hidden] written at each listed expert's rows
    pair_weights: torch.Tensor,  # [P, 1] routing weight of each pair
    firsts: list[int],  # first row of each listed expert
    counts: list[int],  # its rows
    share_starts: list[int],  # share s = entries share_starts[s] .. share_starts[s + 1] - 1
    gate_up: list[torch.Tensor],  # each listed expert's packed gate/up weight (OneDnnLinear)
    down: list[torch.Tensor],  # and down weight
) -> None:
    """Each share's experts on one intra-op thread, the shares side by side
    (kernels/moe_experts.cpp)."""
    torch.ops.tokenmill.moe_experts(
        grouped, outputs, pair_weights, firsts, counts, share_starts, gate_up, down
    )


def moe_fused(
    x: torch.Tensor,  # [T, hidden] fp32
    out: torch.Tensor,  # [T, hidden] fp32: the layer's output is added into it
    logits: torch.Tensor,  # [T, E] the router's logits
    top_k: int,
    renormalize: bool,  # the k routing probabilities renormalised to sum 1 (norm_topk_prob)
    gate_up: torch.Tensor,  # moe.FusedExperts.gate_up
    down: torch.Tensor,  # moe.FusedExperts.down
) -> torch.Tensor:
    """A Qwen3-MoE layer in one call (kernels/moe_fused.cpp); the tokens each expert took ([E]
    int64)."""
    return torch.ops.tokenmill.moe_fused(x, out, logits, top_k, renormalize, gate_up, down)


def panel_linear(
    x: torch.Tensor,  # [T, K] fp32, contiguous
    packed: torch.Tensor,  # [ceil(N / 16), K, 16] (linear.PanelLinear.pack)
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [T, N], added to the product
) -> torch.Tensor:
    """`x W^T (+ bias) (+ residual)`, [T, N] (kernels/panel_linear.cpp)."""
    return torch.ops.tokenmill.panel_linear(x, packed, out_features, bias, residual)


if __name__ == "__main__":  # `make setup`: build once, so no engine start has to
    logging.basicConfig(level=logging.INFO)
    ok = kernels_available()
    print(f"CPU kernels {'built' if ok else 'unavailable (plain torch ops will be used)'}")
    sys.exit(0)
