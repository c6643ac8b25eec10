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
