"""Multi-head latent attention (DeepSeek-V2/V3 and the models that reuse it): per-head GL on the non-rotated
query/key blocks and on values/outputs, one RoPE commutant shared by all heads on the decoupled RoPE part, and the
latent factors left elementwise (docs/symmetries.md)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from hf_geosharp.engine.geometry.lie import rope_commutant_basis
from hf_geosharp.symmetry import map_symmetries, reparametrize

from .fixtures.architectures import _MLA, _causal, _hf, build

# DeepSeek-V2's complex RoPE rotates in float32; DeepSeek-V3's stays in float64
TOLERANCE = {"deepseek_v3_mla": 1e-10, "deepseek_v2_mla_qproj": 1e-6}


def _attention_outputs(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module's output (before the float32 RMSNorm of the head) and the logits."""
    seen = []
    attn = model.model.layers[0].self_attn
    handle = attn.register_forward_hook(lambda module, args, out: seen.append(out[0].detach().clone()))
    try:
        with torch.no_grad():
            logits = model(**batch).logits
    finally:
        handle.remove()
    return seen[0], logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((b - a).norm() / a.norm())


@pytest.mark.parametrize("arch", sorted(TOLERANCE))
def test_mla_blocks_cover_the_pairs_and_leave_the_latent_elementwise(arch):
    model = build(arch).model
    smap = map_symmetries(model, strict=True)
    nope, rope, vo = smap.blocks
    rows_q = 12 if arch == "deepseek_v3_mla" else 32  # q_b_proj reads the q latent, q_proj the hidden state
    assert (nope.kind, tuple(nope.G_index.shape), tuple(nope.H_index.shape)) == ("qk", (4, rows_q, 6), (4, 10, 6))
    bias = int(arch == "deepseek_v3_mla")  # attention_bias: the rotated key's bias is a row of H
    assert (rope.kind, tuple(rope.G_index.shape), tuple(rope.H_index.shape)) == ("qk", (1, 4 * rows_q, 4),
                                                                                 (1, 32 + bias, 4))
    assert rope.group_dim == 4 and "(2j, 2j+1)" in rope.note  # V3 rope_interleave, V2 view_as_complex pairs
    assert (vo.kind, tuple(vo.G_index.shape), tuple(vo.H_index.shape)) == ("vo", (4, 10, 10), (4, 32, 10))
    names = dict(zip(smap.param_names, smap.offsets))
    covered = torch.cat([b.G_index.reshape(-1) for b in smap.blocks] + [b.H_index.reshape(-1) for b in smap.blocks])
    kv_a = smap.index_of("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert not torch.isin(kv_a[:10], covered).any() and torch.isin(kv_a[10:], covered).all()  # latent rows free
    for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight"):
        full = "model.layers.0.self_attn." + name
        if full in names:
            assert not torch.isin(smap.index_of(full).reshape(-1), covered).any(), name
    assert covered.unique().numel() == covered.numel()  # the three groups act on disjoint coordinates


@pytest.mark.parametrize("arch", sorted(TOLERANCE))
def test_mla_reparametrization_leaves_attention_and_logits_unchanged(arch):
    tiny = build(arch)
    attn0, logits0 = _attention_outputs(tiny.model, tiny.batch)
    before = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    reparametrize(tiny.model, seed=1, condition=100.0)
    moved = {n for n, p in tiny.model.named_parameters() if not torch.equal(p, before[n])}
    assert {n.rsplit(".", 2)[-2] for n in moved} >= {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    attn1, logits1 = _attention_outputs(tiny.model, tiny.batch)
    assert _rel(attn0, attn1) < TOLERANCE[arch]
    assert _rel(logits0, logits1) < 1e-6


def _split_rope_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = _hf(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**_MLA, q_lora_rank=12, rope_interleave=False))
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def test_mla_rope_pairing_follows_rope_interleave_and_a_wrong_pairing_is_caught():
    model = _split_rope_model()
    batch = _causal(torch.Generator().manual_seed(0))
    smap = map_symmetries(model, strict=True)
    rope = smap.blocks[1]
    assert "(j, j+r/2)" in rope.note
    attn0, _ = _attention_outputs(model, batch)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    reparametrize(model, seed=1, condition=100.0, symmetry_map=smap)
    assert _rel(attn0, _attention_outputs(model, batch)[0]) < 1e-10
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    rope.lie_basis = rope_commutant_basis(4, 4, interleaved=True)
    smap.blocks = [rope]
    reparametrize(model, seed=1, condition=100.0, symmetry_map=smap)
    assert _rel(attn0, _attention_outputs(model, batch)[0]) > 1e-3


def test_mla_rope_part_needs_one_element_for_all_heads():
    """The rotated key is shared: acting on each head's rotated query slice with its own element is a wrong map."""
    tiny = build("deepseek_v3_mla")
    attn0, _ = _attention_outputs(tiny.model, tiny.batch)
    smap = map_symmetries(tiny.model)
    rope = smap.blocks[1]
    q_rows = rope.G_index.reshape(4, 12, 4)  # per head; the key rows cannot follow four different elements
    rope.G_index, rope.H_index = q_rows[1:2], rope.H_index  # one head's queries moved with the key, others not
    smap.blocks = [rope]
    reparametrize(tiny.model, seed=1, condition=100.0, symmetry_map=smap)
    assert _rel(attn0, _attention_outputs(tiny.model, tiny.batch)[0]) > 1e-3


def test_an_unexplained_parameter_in_mla_is_a_fallback_with_its_name():
    tiny = build("deepseek_v3_mla")
    attn = tiny.model.model.layers[0].self_attn
    attn.gate_proj = torch.nn.Linear(32, 40, dtype=torch.float64)  # an output gate (HY-V4 style) breaks VO
    smap = map_symmetries(tiny.model)
    assert not smap.blocks
    assert [f.module for f in smap.fallbacks] == ["model.layers.0.self_attn"]
    assert "gate_proj.weight" in smap.fallbacks[0].reason
