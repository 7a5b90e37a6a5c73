"""The Mixture-of-Experts block against a plain per-token loop, the router, Qwen3-MoE's
config.json fields and the MoE step-cost estimate."""

from __future__ import annotations

import json

import pytest
import torch

from engines.api import EngineError
from engines.reference.model import moe as moe_module
from engines.reference.model.config import MoeConfig, load_model_config
from engines.reference.model.linear import pack_linears
from engines.reference.model.model import CausalLM, fuse_projections
from engines.reference.model.moe import SparseMoeBlock, route
from engines.reference.runtime.runner import linear_macs_per_token

HIDDEN = 16


def _block(
    norm_topk_prob: bool,
    num_experts: int = 6,
    top_k: int = 2,
    hidden: int = HIDDEN,
    inter: int = 8,
) -> SparseMoeBlock:
    moe = MoeConfig(num_experts, top_k, inter, norm_topk_prob, sparse_layers=(0,))
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden, moe)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block.eval()


def _per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: softmax over experts, top k, optional
    renormalisation, weighted sum of those experts' SwiGLU outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ block.gate.weight.T, dim=-1)
        weights, experts = torch.topk(probs, block.top_k)
        if block.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            mlp = block.experts[e]
            h = torch.nn.functional.silu(x[t] @ mlp.gate_proj.weight.T) * (
                x[t] @ mlp.up_proj.weight.T
            )
            out[t] += w * (h @ mlp.down_proj.weight.T)
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_the_per_token_loop(norm_topk_prob: bool) -> None:
    block = _block(norm_topk_prob)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = _per_token(block, x)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)
        counts = block.last_counts
        assert counts.shape == (6,) and int(counts.sum()) == 37 * 2
        # Fused gate/up and oneDNN linears (the loaded model's path), residual added in place.
        model_like = torch.nn.Module()
        model_like.block = block
        for mlp in block.experts:
            mlp.gate_up_proj = torch.nn.Linear(HIDDEN, 16, bias=False)
            mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        pack_linears(model_like)
        residual = torch.randn(37, HIDDEN)
        torch.testing.assert_close(
            block.forward_add(x, residual.clone()), residual + expected, rtol=1e-5, atol=1e-5
        )


def _packed_block() -> SparseMoeBlock:
    """A block as the loader leaves it: gate/up fused, every linear a OneDnnLinear."""
    block = _block(True, num_experts=8, top_k=2)
    model_like = torch.nn.Module()
    model_like.block = block
    with torch.no_grad():
        for mlp in block.experts:
            mlp.gate_up_proj = torch.nn.Linear(HIDDEN, 16, bias=False)
            mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            del mlp.gate_proj, mlp.up_proj
    pack_linears(model_like)
    return block


@pytest.mark.parametrize("tokens", [1, 5, 37, 300])
def test_experts_side_by_side_equal_one_after_another(
    tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The side-by-side kernel (experts shared out over the threads) against the experts one
    after another, on the same packed block; and that it really ran."""
    from engines.reference.model import cpu_kernels, moe

    if not cpu_kernels.kernels_available():
        pytest.skip("CPU kernels unavailable on this machine")
    block = _packed_block()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    calls: list[int] = []
    real = cpu_kernels.moe_experts
    monkeypatch.setattr(
        cpu_kernels, "moe_experts", lambda *args: (calls.append(len(args[3])), real(*args))
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            monkeypatch.setattr(moe, "SIDE_BY_SIDE_MAX_ROWS", 0)  # never side by side
            one_after_another = block(x)
            assert calls == []
            monkeypatch.setattr(moe, "SIDE_BY_SIDE_MAX_ROWS", 10**9)  # always
            side_by_side = block(x)
            active = int((block.last_counts > 0).sum())
            residual = torch.randn(tokens, HIDDEN)
            added = block.forward_add(x, residual.clone())
    finally:
        torch.set_num_threads(threads)
    assert calls == [active, active]  # every active expert, in one call per forward
    torch.testing.assert_close(side_by_side, one_after_another, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(added, residual + one_after_another, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        side_by_side, _per_token(_block(True, 8, 2), x), rtol=1e-5, atol=1e-5
    )


def _fused_block(norm_topk_prob: bool, hidden: int, inter: int) -> SparseMoeBlock:
    """A block as the loader leaves it on CPU in fp32: gate/up fused, then fuse_experts."""
    block = _block(norm_topk_prob, num_experts=8, top_k=2, hidden=hidden, inter=inter)
    model_like = torch.nn.Module()
    model_like.block = block
    with torch.no_grad():
        for mlp in block.experts:
            mlp.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, bias=False)
            mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            del mlp.gate_proj, mlp.up_proj
    assert moe_module.fuse_experts(model_like) == 1
    pack_linears(model_like)  # the router, as the loader leaves it
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize(("hidden", "inter"), [(16, 8), (20, 12), (64, 40)])
@pytest.mark.parametrize("tokens", [1, 5, 37, 300])
def test_fused_layer_matches_the_per_token_loop(
    norm_topk_prob: bool, hidden: int, inter: int, tokens: int
) -> None:
    """The one-call layer (kernels/moe_fused.cpp) against the definition, with sizes that are
    and are not multiples of its 8- and 16-column blocks, the residual added in place; the
    expert counts; the same bits on one thread and two (work is split by columns only)."""
    from engines.reference.model import cpu_kernels

    if not cpu_kernels.kernels_available():
        pytest.skip("CPU kernels unavailable on this machine")
    reference = _block(norm_topk_prob, num_experts=8, top_k=2, hidden=hidden, inter=inter)
    block = _fused_block(norm_topk_prob, hidden, inter)
    assert len(block.experts) == 0 and block.fused is not None  # one copy of the weights
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    residual = torch.randn(tokens, hidden, generator=generator)
    expected = _per_token(reference, x)
    # fp32 sums in another order: differences scale with the values (up to ~170 at width 64).
    atol = 1e-6 * float(expected.abs().max())
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.inference_mode():
                outputs.append(block.forward_add(x, residual.clone()))
                torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=atol)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outputs[0], residual + expected, rtol=1e-5, atol=atol)
    assert torch.equal(outputs[0], outputs[1])
    probs = torch.softmax(x @ reference.gate.weight.T, dim=-1)
    chosen = torch.topk(probs, 2).indices.flatten()
    assert block.last_counts.tolist() == torch.bincount(chosen, minlength=8).tolist()


def test_fuse_experts_leaves_what_the_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, no kernels, experts already reordered for oneDNN: the experts stay as they are."""
    block = _packed_block()  # gate/up already OneDnnLinears
    holder = torch.nn.Module()
    holder.block = block
    assert moe_module.fuse_experts(holder) == 0 and len(block.experts) == 8
    for dtype, kernels in ((torch.bfloat16, True), (torch.float32, False)):
        monkeypatch.setattr(
            "engines.reference.model.cpu_kernels.use_kernels", lambda device, on=kernels: on
        )
        block = _block(True, num_experts=4).to(dtype)
        holder.block = block
        for mlp in block.experts:
            mlp.gate_up_proj = torch.nn.Linear(HIDDEN, 16, bias=False, dtype=dtype)
        assert moe_module.fuse_experts(holder) == 0
        assert block.fused is None and len(block.experts) == 4


def test_balance_shares_rows_evenly() -> None:
    from engines.reference.model.moe import balance

    spans = [(0, 0, 9), (2, 9, 1), (3, 10, 5), (5, 15, 4), (7, 19, 1)]
    shares = balance(spans, 2)
    assert sorted(e for share in shares for e, _, _ in share) == [0, 2, 3, 5, 7]
    assert sorted(sum(c for _, _, c in share) for share in shares) == [10, 10]
    assert balance(spans[:1], 4) == [[spans[0]]]  # no empty shares


def test_a_single_token_and_unchosen_experts() -> None:
    block = _block(True, num_experts=8, top_k=1)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(block(x), _per_token(block, x), rtol=1e-5, atol=1e-5)
        assert sorted(block.last_counts.tolist()) == [0] * 7 + [1]


def test_route_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, experts = route(logits, 2, norm_topk_prob=False)
    probs = torch.softmax(logits, -1)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = route(logits, 2, norm_topk_prob=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    weights, _ = route(logits.bfloat16(), 2, norm_topk_prob=True)
    assert weights.dtype == torch.bfloat16


MOE_BASE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "eos_token_id": 2,
}


def _write(tmp_path, drop=(), **changes):
    config = {k: v for k, v in {**MOE_BASE, **changes}.items() if k not in drop}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_moe_fields_and_sparse_layers(tmp_path) -> None:
    cfg = load_model_config(_write(tmp_path))
    assert cfg.model_type == "qwen3_moe" and cfg.qk_norm and not cfg.mlp_bias
    assert cfg.moe == MoeConfig(8, 2, 16, True, sparse_layers=(0, 1, 2, 3))
    # transformers' rule: not in mlp_only_layers, and (layer + 1) % decoder_sparse_step == 0.
    cfg = load_model_config(_write(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe.sparse_layers == (1,)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    # transformers 5's save_pretrained spells num_experts as num_local_experts.
    cfg = load_model_config(_write(tmp_path, drop=["num_experts"], num_local_experts=4))
    assert cfg.moe.num_experts == 4
    assert load_model_config(_write(tmp_path, num_experts=0)).moe is None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be between 1 and num_experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
        ({"mlp_only_layers": "0,1"}, "mlp_only_layers must be a list"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"num_experts": 2.5}, "num_experts must be an integer"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_moe_values_are_refused_by_name(tmp_path, changes, words) -> None:
    with pytest.raises(EngineError, match=words):
        load_model_config(_write(tmp_path, **changes))


def test_model_builds_dense_and_sparse_layers_and_fuses_every_expert(tmp_path) -> None:
    cfg = load_model_config(_write(tmp_path, mlp_only_layers=[0]))
    model = CausalLM(cfg)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP"] + [
        "SparseMoeBlock"
    ] * 3
    assert model.model.layers[1].mlp.experts[7].gate_proj.weight.shape == (16, 32)
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    fuse_projections(model)
    assert all(e.gate_up_proj is not None for e in model.model.layers[3].mlp.experts)


def test_step_cost_counts_only_the_active_experts(tmp_path) -> None:
    cfg = load_model_config(_write(tmp_path, mlp_only_layers=[0]))
    attention = 32 * (2 * 32 + 2 * 16)
    dense = 3 * 32 * 64
    sparse = 32 * (8 + 3 * 2 * 16)  # the router, then k experts
    assert linear_macs_per_token(cfg) == attention + (dense + 3 * sparse) // 4
