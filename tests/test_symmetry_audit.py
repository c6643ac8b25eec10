"""Dimension audit: the Jacobian rank of a one-layer attention model is what the map predicts, and no more."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_geosharp.symmetry import PairBlock, map_symmetries
from hf_geosharp.symmetry.audit import jacobian_rank_audit

EMBED, HEADS, TOKENS = 8, 2, 6


def _attention(bias: bool) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    model = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, bias=bias).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def _inputs(gen: torch.Generator, n_tokens: int) -> dict:
    x = torch.randn(-(-n_tokens // TOKENS), TOKENS, EMBED, generator=gen, dtype=torch.float64)
    return {"query": x, "key": x, "value": x, "need_weights": True}  # explicit softmax path: vmap-friendly


@pytest.mark.parametrize("bias", [True, False])
def test_rank_matches_the_quotient_up_to_the_named_redundancies(bias):
    model = _attention(bias)
    result = jacobian_rank_audit(model, inputs=_inputs, n_draws=2)
    d = EMBED // HEADS
    n_params = sum(p.numel() for p in model.parameters())
    assert result.n_params == n_params
    assert result.orbit_dim == 2 * HEADS * d * d  # one GL(d) per QK and per VO head
    assert result.n_inactive == 0
    expected = {"key bias (invisible to softmax)": EMBED, "value bias (absorbed by the output bias)": EMBED}
    assert result.redundancies == (expected if bias else {})
    # the measured rank is exactly the quotient dimension minus the named redundancies: nothing is left unexplained
    assert result.rank == n_params - result.orbit_dim - sum(expected.values() if bias else [0])
    assert result.gap == 0


def test_the_gap_exposes_symmetries_the_map_misses_and_claims_it_should_not():
    model = _attention(bias=False)
    d = EMBED // HEADS
    smap = map_symmetries(model)
    smap.blocks = [b for b in smap.blocks if b.kind == "qk"]  # forget the VO symmetry
    assert jacobian_rank_audit(model, smap, inputs=_inputs, n_draws=1).gap == HEADS * d * d

    smap = map_symmetries(model)
    qk = next(b for b in smap.blocks if b.kind == "qk")
    smap.blocks.append(PairBlock("qk", qk.module, qk.G_index, qk.H_index))  # claim the QK orbits twice
    assert jacobian_rank_audit(model, smap, inputs=_inputs, n_draws=1).gap == -HEADS * d * d


def test_audit_refuses_big_models_with_advice():
    model = nn.MultiheadAttention(64, 4)
    with pytest.raises(ValueError, match="tiny models"):
        jacobian_rank_audit(model, inputs=_inputs, max_params=1000)


def _bert(hidden: int, heads: int, layers: int = 1):
    import transformers as tf

    config = tf.BertConfig(vocab_size=200, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=16, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.BertModel(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def test_block_audit_whole_block_predicts_the_rank_term_by_term():
    from hf_geosharp.symmetry.audit_blocks import block_audit

    model = _bert(16, 2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    (result,) = block_audit(model, [0], log=lambda _: None)
    e, d, h = 16, 8, 2
    assert result.scope == "whole block" and result.n_params == 4 * (e * e + e) + 2 * e
    assert result.input_rank == {"width": e, "x": e, "x1": e}  # LayerNorm'd input: [X, 1] loses one dimension
    assert result.terms == {
        "QK orbit (2 pair(s) x GL(8))": h * d * d, "VO orbit (2 pair(s) x GL(8))": h * d * d,
        "input subspace ([X, 1] n = 0) of W_q, W_k, W_v": 3 * e,
        "key bias (invisible to softmax)": e, "value bias (absorbed by the output bias)": e,
        "output LayerNorm: W_O rows along 1": e, "output LayerNorm: output bias along 1": 1}
    assert result.rank == result.predicted_rank and result.verdict == "PASS"
    assert result.singular_values_at_cut[1] < 1e-12 < result.singular_values_at_cut[0]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing of the model moved
    assert not model.training


def test_block_audit_slice_and_a_wrong_map_fails():
    from hf_geosharp.symmetry.audit_blocks import block_audit

    model = _bert(32, 4)
    (sliced,) = block_audit(model, [0], max_params=700, heads=1, dims=2, log=lambda _: None)
    assert sliced.scope.startswith("slice") and sliced.n_params == 2 * 2 * 33 + 2 * 33 + 2 * 32 + 32
    assert sliced.verdict == "PASS"
    small = _bert(16, 2)
    smap = map_symmetries(small)
    qk = next(b for b in smap.blocks if b.kind == "qk")
    smap.blocks.append(PairBlock("qk", qk.module, qk.G_index, qk.H_index))  # claims the QK orbits twice
    (wrong,) = block_audit(small, [0], smap, log=lambda _: None)
    # the duplicate is counted with all its terms: orbit 2 x 8 x 8, input subspace 2 x 16, key bias 16
    assert wrong.verdict == "FAIL" and wrong.rank - wrong.predicted_rank == 2 * 8 * 8 + 2 * 16 + 16
