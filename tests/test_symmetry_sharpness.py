"""End to end: geodesic sharpness is invariant under the mapped symmetry group, adaptive sharpness is not."""

from __future__ import annotations

import pytest

import hf_geosharp as gs
from hf_geosharp.symmetry import reparametrize

from .fixtures.architectures import build

# one per layout family (every layout passes; the subset keeps the suite fast): separate q/k/v, Conv1D, GQA + RoPE
# commutant, interleaved fused + partial rotary, Falcon grouped, fused blocks + GQA + partial rotary, encoder-decoder
# with cross-attention, nn.MultiheadAttention, PEFT LoRA, GPTBigCode (multi-query and per head), DeBERTa (v2 with
# shared and separate position projections, v1), multi-head latent attention; mix on a plain, a reduced-group and a
# DeBERTa model
CASES = [("bert", "inv"), ("bert", "mix"), ("gpt2_conv1d", "inv"), ("llama_gqa", "inv"), ("llama_gqa", "mix"),
         ("gpt_neox_partial", "inv"), ("falcon_grouped", "inv"), ("phi3_fused", "inv"), ("bart", "inv"),
         ("mha", "inv"), ("lora", "inv"), ("gpt_bigcode_mqa", "inv"), ("gpt_bigcode_mha", "inv"),
         ("deberta_v2_shared", "inv"), ("deberta_v2_separate", "mix"), ("deberta", "inv"), ("deepseek_v3_mla", "inv")]


@pytest.mark.parametrize("arch,metric", CASES)
def test_geodesic_sharpness_is_invariant_under_reparametrization(arch, metric):
    tiny = build(arch)
    model, batches = tiny.model, [tiny.batch]
    common = dict(rho=0.05, steps=2, seed=0, progress=False)

    geodesic_before = gs.geodesic_sharpness(model, batches, metric=metric, epsilon=0.0, **common).value
    adaptive_before = gs.adaptive_sharpness(model, batches, **common).value
    reparametrize(model, seed=1, condition=100.0)
    geodesic_after = gs.geodesic_sharpness(model, batches, metric=metric, epsilon=0.0, **common).value
    adaptive_after = gs.adaptive_sharpness(model, batches, **common).value

    assert geodesic_before > 0
    assert abs(geodesic_after - geodesic_before) <= 1e-6 * abs(geodesic_before)
    assert abs(adaptive_after - adaptive_before) > 0.05 * abs(adaptive_before)
