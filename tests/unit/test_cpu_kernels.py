"""The CPU kernels against the torch ops they replace: paged attention against plain attention
over each row's gathered context (with GPT-OSS's sinks and sliding window: against the model's
masked SDPA path, attend_with_sinks), the fused element-wise ops against their torch spelling."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engines.reference.model.cpu_kernels import kernels_available, paged_attention
from engines.reference.model.model import attend_with_sinks

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler for the kernel")


def reference(q, k_cache, v_cache, rows, req, limit, tables, block_size):
    """Gather each row's keys 0..limit-1 block by block, then SDPA with GQA."""
    kvh, dim = k_cache.shape[0], k_cache.shape[3]
    out = torch.zeros_like(q)
    for r, row in enumerate(rows.tolist()):
        keys = int(limit[r])
        blocks = tables[int(req[r])].long()
        slots = (
            blocks[torch.arange(keys) // block_size] * block_size + torch.arange(keys) % block_size
        )
        k = k_cache.reshape(kvh, -1, dim)[:, slots].float()  # [KVH, L, D]
        v = v_cache.reshape(kvh, -1, dim)[:, slots].float()
        qr = q[row].float().view(kvh, -1, dim)  # [KVH, G, D]
        out[row] = F.scaled_dot_product_attention(qr, k, v).reshape(-1, dim).to(q.dtype)
    return out


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_matches_gathered_attention(dtype, tol, heads: int, kv_heads: int) -> None:
    rng = random.Random(heads * 10 + kv_heads)
    torch.manual_seed(0)
    dim, block_size, num_blocks = {8: 32, 4: 128, 6: 64}[heads], 8, 64  # generic and unrolled
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim).to(dtype)
    # Requests with scattered blocks; some verify a chunk of n queries (causal limits), some
    # decode one; a limit at a block boundary and a single-key context are included.
    tables, rows, req, limit = [], [], [], []
    row = 0
    for i, (context, n) in enumerate([(1, 1), (8, 1), (9, 1), (40, 5), (63, 3), (17, 1)]):
        blocks = rng.sample(range(num_blocks), -(-context // block_size))
        tables.append(blocks + [0] * (8 - len(blocks)))
        for j in range(n):
            rows.append(row)
            req.append(i)
            limit.append(context - n + 1 + j)
            row += 1
    total = row + 3  # rows the kernel must leave alone
    q = torch.randn(total, heads, dim).to(dtype)
    args = (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(req, dtype=torch.int32),
        torch.tensor(limit, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
    )
    out = torch.full_like(q, 7.0)
    paged_attention(out, q, k_cache, v_cache, *args, scale=dim**-0.5)
    expected = reference(q, k_cache, v_cache, *args, block_size)
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), rtol=tol, atol=tol)
    assert torch.all(out[row:] == 7.0)  # untouched


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8])
def test_every_group_size_with_prefill_chunks_and_decode_rows(group: int, dim: int) -> None:
    # One call as a step makes it: a prefill chunk continuing a cached prompt (limits 31..100),
    # a fresh prompt's chunk, and decode rows, split over the threads by their key counts.
    rng = random.Random(group * dim)
    torch.manual_seed(group)
    kvh, bs, num_blocks = 2, 16, 96
    k_cache = torch.randn(kvh, num_blocks, bs, dim)
    v_cache = torch.randn(kvh, num_blocks, bs, dim)
    free = rng.sample(range(num_blocks), num_blocks)
    tables, rows, req, limit = [], [], [], []
    for i, (context, n) in enumerate([(100, 70), (20, 20), (57, 1), (1, 1), (33, 1)]):
        blocks = [free.pop() for _ in range(-(-context // bs))]
        tables.append(blocks + [0] * (7 - len(blocks)))
        for j in range(n):
            rows.append(len(rows))
            req.append(i)
            limit.append(context - n + 1 + j)
    q = torch.randn(len(rows), kvh * group, dim)
    args = (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(req, dtype=torch.int32),
        torch.tensor(limit, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
    )
    out = torch.empty_like(q)
    paged_attention(out, q, k_cache, v_cache, *args, scale=dim**-0.5)
    expected = reference(q, k_cache, v_cache, *args, bs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_many_rows_run_in_parallel_and_agree() -> None:
    torch.manual_seed(1)
    kvh, heads, dim, bs = 2, 8, 64, 16
    k_cache, v_cache = torch.randn(kvh, 256, bs, dim), torch.randn(kvh, 256, bs, dim)
    rows = torch.arange(64)
    req = torch.arange(64, dtype=torch.int32)
    limit = torch.randint(1, 16 * 4, (64,), dtype=torch.int32)
    tables = torch.randperm(256, dtype=torch.int32)[: 64 * 4].view(64, 4).contiguous()
    q = torch.randn(64, heads, dim)
    out = torch.empty_like(q)
    paged_attention(out, q, k_cache, v_cache, rows, req, limit, tables, scale=dim**-0.5)
    expected = reference(q, k_cache, v_cache, rows, req, limit, tables, bs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_a_prefill_row_gets_the_same_bits_however_the_step_is_cut_or_split(group: int) -> None:
    # Rows with company from their own request go in tiles of 16 // G rows; a row's result must
    # not depend on which rows share its tile (chunk boundaries), on the thread count, or on
    # what else is in the step (the split over threads moves with it).
    torch.manual_seed(group)
    kvh, dim, bs = 2, 64, 16
    k_cache, v_cache = random_caches(kvh, dim, torch.float32, block_size=bs, num_blocks=128)
    rows, req, limit, tables = build_step([(90, 70), (3, 1), (40, 40)], bs, 128, seed=group)
    q = torch.randn(int(rows.shape[0]), kvh * group, dim)

    def attend(picked: slice, threads: int) -> torch.Tensor:
        out = torch.zeros_like(q)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            paged_attention(
                out,
                q,
                k_cache,
                v_cache,
                rows[picked],
                req[picked],
                limit[picked],
                tables,
                scale=dim**-0.5,
            )
        finally:
            torch.set_num_threads(before)
        return out

    whole = attend(slice(None), 2)
    assert torch.equal(attend(slice(None), 1), whole)
    # The first request's 70 rows as chunks of 2, 5 and 63 rows, each call on its own.
    pieces = [attend(slice(a, b), 2) for a, b in [(0, 2), (2, 7), (7, 70)]]
    assert torch.equal(sum(pieces)[:70], whole[:70])
    torch.testing.assert_close(
        whole, reference(q, k_cache, v_cache, rows, req, limit, tables, bs), rtol=1e-5, atol=1e-5
    )


def test_bad_indices_fail_with_a_message_not_a_crash() -> None:
    k_cache = v_cache = torch.zeros(1, 4, 8, 16)
    q = torch.zeros(2, 2, 16)
    out = torch.empty_like(q)
    rows, req = torch.tensor([0, 1]), torch.tensor([0, 0], dtype=torch.int32)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    ok = torch.tensor([5, 16], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 1 attends to 17 keys, more keys than its table"):
        too_long = torch.tensor([5, 17], dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, rows, req, too_long, tables, scale=1.0)
    with pytest.raises(RuntimeError, match=r"block id 9 outside the cache \(4 blocks\)"):
        bad = torch.tensor([[1, 9]], dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, rows, req, ok, bad, scale=1.0)
    with pytest.raises(RuntimeError, match=r"row 2 outside q \(2 rows\)"):
        paged_attention(out, q, k_cache, v_cache, torch.tensor([0, 2]), req, ok, tables, scale=1.0)
    with pytest.raises(RuntimeError, match="table index 1 of row 0 outside tables"):
        one = torch.tensor([1, 0], dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, rows, one, ok, tables, scale=1.0)


# --- sinks and the sliding window (GPT-OSS) against the masked SDPA path ---------------------

# (context length, query rows) per request of one step: decode rows (one of a single key, one
# at a block boundary), a verification chunk, a prefill chunk continuing a cached prompt and a
# fresh prompt's whole prefill, of different lengths.
MIXED_STEP = [(1, 1), (16, 1), (9, 1), (40, 5), (63, 30), (20, 20), (33, 1)]


def build_step(
    chunks: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """rows, req, limit, tables of one step of `chunks`, blocks scattered over the pool; query
    j of an n-row chunk over a context of L keys attends to keys 0 .. L - n + j."""
    rng = random.Random(seed)
    free = rng.sample(range(num_blocks), num_blocks)
    width = max(-(-context // block_size) for context, _ in chunks)
    tables, rows, req, limit = [], [], [], []
    for i, (context, n) in enumerate(chunks):
        blocks = [free.pop() for _ in range(-(-context // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        for j in range(n):
            rows.append(len(rows))
            req.append(i)
            limit.append(context - n + 1 + j)
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(req, dtype=torch.int32),
        torch.tensor(limit, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
    )


def masked_reference(
    q, k_cache, v_cache, rows, req, limit, tables, sinks: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """Each row through the model's SDPA path: attend_with_sinks over the row's gathered keys
    (fp32), the window as its boolean mask (keys after p - window for a row at position p, as
    the runner's window masks), no sinks as sinks of -inf."""
    kvh, _, block_size, dim = k_cache.shape
    heads = q.shape[1]
    head_sinks = torch.full((heads,), float("-inf")) if sinks is None else sinks.float()
    out = torch.zeros_like(q)
    for r, row in enumerate(rows.tolist()):
        keys = int(limit[r])
        blocks = tables[int(req[r])].long()
        at = torch.arange(keys)
        slots = blocks[at // block_size] * block_size + at % block_size
        k = k_cache.reshape(kvh, -1, dim)[:, slots].float().unsqueeze(0)  # [1, KVH, L, D]
        v = v_cache.reshape(kvh, -1, dim)[:, slots].float().unsqueeze(0)
        qr = q[row].float().view(1, heads, 1, dim)
        mask = at > keys - 1 - window if window else torch.ones(keys, dtype=torch.bool)
        o = attend_with_sinks(
            qr, k, v, mask.view(1, 1, 1, keys), head_sinks.view(1, heads, 1, 1), enable_gqa=True
        )
        out[row] = o.view(heads, dim).to(q.dtype)
    return out


def random_caches(
    kv_heads: int, dim: int, dtype: torch.dtype, block_size: int = 8, num_blocks: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (kv_heads, num_blocks, block_size, dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
# Head sizes of the plain loop (16: the tiny GPT-OSS; 32) and of the unrolled fp32 code.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (4, 4, 32), (8, 2, 64)])
# 1: the row's own key only; 4: a few blocks' worth cut mid-block; 1000: longer than any context.
@pytest.mark.parametrize("window", [None, 1, 4, 1000])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_sinks_and_window_match_the_masked_sdpa_path(
    dtype, tol, heads: int, kv_heads: int, dim: int, window: int | None, with_sinks: bool
) -> None:
    torch.manual_seed(heads * dim + (window or 0))
    k_cache, v_cache = random_caches(kv_heads, dim, dtype)
    index = build_step(MIXED_STEP, 8, 64, seed=dim)
    q = torch.randn(int(index[0].shape[0]) + 2, heads, dim).to(dtype)  # 2 rows left alone
    # Sinks around the scores' size, so they take a visible share of each softmax.
    sinks = torch.randn(heads) * 2 if with_sinks else None
    out = torch.full_like(q, 7.0)
    paged_attention(out, q, k_cache, v_cache, *index, scale=dim**-0.5, sinks=sinks, window=window)
    expected = masked_reference(q, k_cache, v_cache, *index, sinks, window)
    rows = index[0]
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), rtol=tol, atol=tol)
    assert torch.all(out[-2:] == 7.0)  # untouched


@pytest.mark.parametrize("dim", [16, 64])  # the plain loop and the unrolled fp32 code
def test_sinks_of_minus_infinity_and_a_window_past_the_context_change_nothing(dim: int) -> None:
    torch.manual_seed(dim)
    heads = 8
    k_cache, v_cache = random_caches(2, dim, torch.float32)
    index = build_step(MIXED_STEP, 8, 64, seed=1)
    q = torch.randn(int(index[0].shape[0]), heads, dim)

    def attend(**extra) -> torch.Tensor:
        out = torch.empty_like(q)
        paged_attention(out, q, k_cache, v_cache, *index, scale=dim**-0.5, **extra)
        return out

    plain = attend()
    # exp(-inf - max) is exactly 0 and the max is unchanged: bit for bit the plain softmax.
    assert torch.equal(attend(sinks=torch.full((heads,), float("-inf"))), plain)
    assert torch.equal(attend(window=max(c for c, _ in MIXED_STEP)), plain)
    assert torch.equal(attend(window=0), plain)  # 0: no window


def test_a_window_of_one_attends_to_the_row_itself() -> None:
    # One key left: its softmax share is 1 without a sink, sigmoid(score - sink) with one.
    torch.manual_seed(3)
    heads, dim = 4, 64
    k_cache, v_cache = random_caches(1, dim, torch.float32)
    rows, req, limit, tables = build_step([(30, 4), (5, 1)], 8, 64, seed=3)
    q = torch.randn(rows.shape[0], heads, dim)
    sinks = torch.tensor([0.0, 1.0, -2.0, float("-inf")])
    out = torch.empty_like(q)
    paged_attention(out, q, k_cache, v_cache, rows, req, limit, tables, dim**-0.5, sinks, 1)
    for r in range(rows.shape[0]):
        position = int(limit[r]) - 1
        block, offset = int(tables[int(req[r])][position // 8]), position % 8
        k, v = k_cache[0, block, offset], v_cache[0, block, offset]
        share = torch.sigmoid(q[r] @ k * dim**-0.5 - sinks)  # [H]; 1 for the -inf sink
        torch.testing.assert_close(out[r], share[:, None] * v, rtol=1e-5, atol=1e-5)


def test_many_rows_with_sinks_and_a_window_split_over_threads_and_agree() -> None:
    # Enough (row, KV head) pairs for the threads, split by the keys inside each row's window.
    torch.manual_seed(5)
    kvh, heads, dim, bs = 2, 8, 64, 16
    k_cache, v_cache = random_caches(kvh, dim, torch.float32, block_size=bs, num_blocks=1024)
    chunks = [(int(c), 1) for c in torch.randint(1, 200, (48,))] + [(150, 64)]
    index = build_step(chunks, bs, 1024, seed=5)
    q = torch.randn(int(index[0].shape[0]), heads, dim)
    sinks = torch.randn(heads)
    out = torch.empty_like(q)
    paged_attention(out, q, k_cache, v_cache, *index, scale=dim**-0.5, sinks=sinks, window=24)
    expected = masked_reference(q, k_cache, v_cache, *index, sinks, 24)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_sinks_or_window_fail_with_a_message() -> None:
    k_cache = v_cache = torch.zeros(1, 4, 8, 16)
    q = torch.zeros(2, 2, 16)
    out = torch.empty_like(q)
    index = build_step([(5, 2)], 8, 4, seed=0)
    with pytest.raises(RuntimeError, match=r"expected one per query head \(2\)"):
        paged_attention(out, q, k_cache, v_cache, *index, scale=1.0, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="floating CPU tensor"):
        ints = torch.zeros(2, dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, *index, scale=1.0, sinks=ints)
    with pytest.raises(RuntimeError, match="window -1 is negative"):
        paged_attention(out, q, k_cache, v_cache, *index, scale=1.0, window=-1)


# --- fused element-wise ops against the torch ops they replace ---------------------------------


def _torch_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_and_add_rms_norm(dtype, tol) -> None:
    from engines.reference.model.cpu_kernels import add_rms_norm, rms_norm

    torch.manual_seed(0)
    weight = torch.rand(96).to(dtype) + 0.5
    for shape in [(1, 96), (70, 96), (5, 3, 96)]:  # one row, many rows (threads), q-norm shape
        x = torch.randn(shape).to(dtype)
        torch.testing.assert_close(
            rms_norm(x, weight, 1e-6), _torch_rms(x, weight, 1e-6), rtol=tol, atol=tol
        )
    strided = torch.randn(7, 200).to(dtype)[:, 10:106]  # a slice of a wider row, like q of qkv
    torch.testing.assert_close(
        rms_norm(strided, weight, 1e-5), _torch_rms(strided, weight, 1e-5), rtol=tol, atol=tol
    )
    for rows in (40, 2000):  # one thread, then enough rows for several
        x, delta = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
        expected_sum = x + delta
        normed = add_rms_norm(x, delta, weight, 1e-6)
        assert torch.equal(x, expected_sum)  # the residual stream, updated in place
        expected = _torch_rms(expected_sum, weight, 1e-6)
        torch.testing.assert_close(normed, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=["fp32", "bf16"])
def test_rope_on_a_slice_of_qkv(dtype, tol) -> None:
    from engines.reference.model.cpu_kernels import rope

    torch.manual_seed(1)
    tokens, heads, dim = 37, 4, 32
    qkv = torch.randn(tokens, heads * dim + 2 * 2 * dim).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # non-contiguous rows, as in the model
    angles = torch.randn(tokens, 1, dim // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    half = dim // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    expected = q * cos + rotated * sin
    got = rope(q, cos, sin)
    assert got.is_contiguous() and got.shape == q.shape
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=["fp32", "bf16"])
def test_rope_cache_writes_k_and_v_into_their_slots(dtype, tol) -> None:
    from engines.reference.model.cpu_kernels import rope, rope_cache

    torch.manual_seed(4)
    tokens, heads, kvh, dim, blocks, bs = 300, 4, 2, 32, 40, 8  # enough rows for the threads
    qkv = torch.randn(tokens, (heads + 2 * kvh) * dim).to(dtype)
    angles = torch.randn(tokens, 1, dim // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    k_cache = torch.full((kvh, blocks, bs, dim), 5.0).to(dtype)
    v_cache = torch.full((kvh, blocks, bs, dim), 5.0).to(dtype)
    slots = torch.randperm(blocks * bs)[:tokens]
    q, k, v = qkv.split([heads * dim, kvh * dim, kvh * dim], dim=-1)
    got = rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads)
    torch.testing.assert_close(got, rope(q.view(tokens, heads, dim), cos, sin), rtol=0, atol=0)
    k_roped = rope(k.view(tokens, kvh, dim), cos, sin)
    k_flat, v_flat = k_cache.view(kvh, -1, dim), v_cache.view(kvh, -1, dim)
    assert torch.equal(k_flat[:, slots], k_roped.transpose(0, 1))
    assert torch.equal(v_flat[:, slots], v.view(tokens, kvh, dim).transpose(0, 1))
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(k_flat[:, untouched] == 5.0) and torch.all(v_flat[:, untouched] == 5.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = slots.clone()
        bad[7] = blocks * bs
        rope_cache(qkv, cos, sin, k_cache, v_cache, bad, heads)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=["fp32", "bf16"])
def test_rope_cache_with_qwen3_head_norms(dtype, tol) -> None:
    """Qwen3's q/k head RMSNorms inside rope_cache: the same numbers as the rms_norm kernel,
    then rope, then the cache writes; V is written as projected (not normalised)."""
    from engines.reference.model.cpu_kernels import rms_norm, rope, rope_cache

    torch.manual_seed(5)
    tokens, heads, kvh, dim, blocks, bs = 70, 4, 2, 32, 20, 8
    qkv = (torch.randn(tokens, (heads + 2 * kvh) * dim) * 3).to(dtype)
    angles = torch.randn(tokens, 1, dim // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_norm, k_norm = torch.rand(dim).to(dtype) + 0.5, torch.rand(dim).to(dtype) + 0.5
    k_cache = torch.zeros(kvh, blocks, bs, dim, dtype=dtype)
    v_cache = torch.zeros(kvh, blocks, bs, dim, dtype=dtype)
    slots = torch.randperm(blocks * bs)[:tokens]
    q, k, v = qkv.split([heads * dim, kvh * dim, kvh * dim], dim=-1)
    got = rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, (q_norm, k_norm, 1e-6))
    q_ref = rope(rms_norm(q.reshape(tokens, heads, dim), q_norm, 1e-6), cos, sin)
    k_ref = rope(rms_norm(k.reshape(tokens, kvh, dim), k_norm, 1e-6), cos, sin)
    torch.testing.assert_close(got, q_ref, rtol=tol, atol=tol)
    k_flat, v_flat = k_cache.view(kvh, -1, dim), v_cache.view(kvh, -1, dim)
    torch.testing.assert_close(k_flat[:, slots], k_ref.transpose(0, 1), rtol=tol, atol=tol)
    assert torch.equal(v_flat[:, slots], v.reshape(tokens, kvh, dim).transpose(0, 1))
    with pytest.raises(RuntimeError, match="both head norms or neither"):
        torch.ops.tokenmill.rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, q_norm)


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=["fp32", "bf16"])
def test_silu_mul(dtype, tol) -> None:
    from engines.reference.model.cpu_kernels import silu_mul

    torch.manual_seed(2)
    gate_up = (torch.randn(50, 2 * 88) * 6).to(dtype)  # large |gate| too: exp's clamped range
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol
    )


def test_a_build_lock_left_by_a_killed_build_is_removed_a_fresh_one_kept(tmp_path) -> None:
    import os
    import time

    from engines.reference.model.cpu_kernels import _remove_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    _remove_stale_lock(lock)
    assert lock.exists()  # another process may be building right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    _remove_stale_lock(lock)
    assert not lock.exists()
    _remove_stale_lock(lock)  # nothing there: nothing to do


def test_each_torch_install_builds_into_its_own_directory() -> None:
    """Two environments on one node (Serve's and the engine's, the suite's two venvs) share the
    cache: one build directory each, or each load would rebuild the other's (the build files
    name the include paths of the torch they link against)."""
    import subprocess
    import sys
    from pathlib import Path

    from engines.reference.model.cpu_kernels import _build_dir

    other = Path(__file__).resolve().parents[2] / ".venv-trtllm" / "bin" / "python"
    if not other.is_file() or Path(sys.executable) == other:
        pytest.skip("needs .venv-trtllm (make setup-trtllm), run from another environment")
    code = "from engines.reference.model.cpu_kernels import _build_dir; print(_build_dir())"
    theirs = subprocess.run(
        [str(other), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert theirs != str(_build_dir())
    assert Path(theirs).parent == _build_dir().parent  # the same cache, another directory


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("rows", [3, 200], ids=["decode", "prefill"])
def test_lora_add_matches_each_rows_adapter_in_torch(dtype, tol, rows: int) -> None:
    """Rows of three slots, a slot with width 0 and rows with no slot: each row gets its own
    slot's B A x added, nothing else; the padding past a slot's width is never read."""
    from engines.reference.model.cpu_kernels import lora_add

    torch.manual_seed(rows)
    fan_in, fan_out, num_slots, width = 96, 80, 4, 24
    widths = torch.tensor([24, 8, 0, 16])
    a = torch.randn(num_slots, width, fan_in).to(dtype)
    b = torch.randn(num_slots, fan_out, width).to(dtype)
    for s, k in enumerate(widths.tolist()):  # garbage past the width: must not count
        a[s, k:] = 1e6
        b[s, :, k:] = 1e6
    x = torch.randn(rows, fan_in).to(dtype)
    slots = torch.randint(-1, num_slots, (rows,))
    y = torch.randn(rows, fan_out).to(dtype)
    want = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        k = int(widths[s]) if s >= 0 else 0
        if k:
            want[t] += b[s, :, :k].float() @ (a[s, :k].float() @ x[t].float())
    lora_add(y, x, a, b, slots, widths)
    scale = want.abs().max()
    assert torch.allclose(y.float(), want, atol=tol * scale, rtol=tol)


def test_lora_add_refuses_what_it_cannot_do() -> None:
    from engines.reference.model.cpu_kernels import lora_add

    y, x = torch.zeros(2, 8), torch.zeros(2, 4)
    a, b = torch.zeros(2, 3, 4), torch.zeros(2, 8, 3)
    with pytest.raises(RuntimeError, match="slot of row 1 out of range"):
        lora_add(y, x, a, b, torch.tensor([0, 2]), torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match="width of slot 0 out of range"):
        lora_add(y, x, a, b, torch.tensor([0, 1]), torch.tensor([4, 3]))
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        lora_add(y, torch.zeros(2, 5), a, b, torch.tensor([0, 1]), torch.tensor([3, 3]))


def test_a_copy_of_the_package_elsewhere_compiles_the_same_staged_sources(
    tmp_path, monkeypatch
) -> None:
    """A Ray job's working_dir holds another copy of the package: its sources are staged to the
    same paths in the build directory, untouched, so torch's build file does not change and
    nothing is rebuilt (it rebuilds whenever the source paths in that file change)."""
    import shutil
    from pathlib import Path

    from engines.reference.model import cpu_kernels

    build = tmp_path / "build"
    build.mkdir()
    here = cpu_kernels._staged_sources(build)
    stamps = {p: p.stat().st_mtime_ns for p in (build / "src").iterdir()}
    copy = tmp_path / "working_dir" / "kernels"
    shutil.copytree(Path(cpu_kernels.__file__).parents[1] / "kernels", copy)
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [copy / s.name for s in cpu_kernels._SOURCES])
    monkeypatch.setattr(cpu_kernels, "_HEADERS", [copy / h.name for h in cpu_kernels._HEADERS])
    assert cpu_kernels._staged_sources(build) == here
    assert {p: p.stat().st_mtime_ns for p in (build / "src").iterdir()} == stamps
    assert all(p.parent == build / "src" for p in here)
    assert {p.name for p in (build / "src").iterdir()} >= {"fast_exp.h", "panel.h", "lora.cpp"}


def test_a_process_with_another_ninja_on_its_path_reuses_the_build() -> None:
    """A process whose PATH lacks the environment's bin (a Ray worker, `.venv/bin/pytest` run
    without activating) would find the system's ninja, whose build log the package's ninja
    does not read, and each would rebuild after the other. Both build with the package's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engines.reference.model.cpu_kernels import _build_dir

    library = _build_dir() / "tokenmill_cpu_kernels.so"
    code = "from engines.reference.model.cpu_kernels import kernels_available as k; print(k())"
    stamps = []
    for path in (f"{Path(sys.executable).parent}:/usr/bin:/bin", "/usr/bin:/bin"):
        env = {**os.environ, "PATH": path}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert proc.stdout.strip() == "True", proc.stderr[-2000:]
        stamps.append(library.stat().st_mtime_ns)
    assert stamps[0] == stamps[1], "a process with the other ninja on its PATH rebuilt"
