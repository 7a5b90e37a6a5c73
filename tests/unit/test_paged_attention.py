"""The CPU paged-attention kernel against plain attention over each row's gathered context."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engines.reference.paged_attention import kernel_available, paged_attention

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the kernel")


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
    dim, block_size, num_blocks = 32, 8, 64
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


def test_bad_indices_fail_with_a_message_not_a_crash() -> None:
    k_cache = v_cache = torch.zeros(1, 4, 8, 16)
    q = torch.zeros(2, 2, 16)
    out = torch.empty_like(q)
    rows, req = torch.tensor([0, 1]), torch.tensor([0, 0], dtype=torch.int32)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="more keys than its table"):
        too_long = torch.tensor([5, 17], dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, rows, req, too_long, tables, scale=1.0)
    with pytest.raises(RuntimeError, match="block id outside"):
        bad = torch.tensor([[1, 9]], dtype=torch.int32)
        ok = torch.tensor([5, 16], dtype=torch.int32)
        paged_attention(out, q, k_cache, v_cache, rows, req, ok, bad, scale=1.0)
