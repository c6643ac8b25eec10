"""Adapters: recognise one attention layout in a live module and describe it as index maps.

Every adapter looks at a module of the instantiated model (its class, children and attributes; never checkpoint
keys) and either returns ``None`` (not this layout), an :class:`AttentionLayout` (q, k, v and o projections as flat
index tensors in ``nn.Linear`` orientation, plus heads, RoPE and qk-norm), or raises :class:`Unmappable` when it
recognises the layout but cannot map it safely. Turning a layout into GL(h) pairs is done once, in
:mod:`hf_geosharp.symmetry.mapping`, for all layouts alike.

The adapters live in one module per family (:mod:`.separate`, :mod:`.fused`, :mod:`.disentangled`) over the shared
description (:mod:`.layout`) and module introspection (:mod:`.introspect`); this module is the registry.
:func:`~hf_geosharp.symmetry.map_symmetries` tries :data:`ADAPTERS` in order and the first adapter that recognises a
module wins, so an adapter that recognises a special case of another's layout must come first: :data:`PRECEDES`
declares each such overlap.
"""

from __future__ import annotations

from .disentangled import deberta, deberta_v2
from .fused import codegen, falcon, fused_blocks, gpt2_conv1d, gpt_bigcode, interleaved_qkv, multihead_attention
from .latent import latent_attention
from .layout import Adapter, AttentionLayout, DecoupledRope, LayoutContext, Proj, Unmappable, is_lora_layer, unwrap_lora
from .separate import separate_qkv

# adapter -> the more generic adapters it must be tried before, because they would also recognise its modules and
# map them wrongly. Listed in the order the adapters are tried; tests/test_symmetry_mapping.py checks that every
# overlap seen on the tiny models is declared here, the specific adapter first.
PRECEDES: dict[Adapter, tuple[Adapter, ...]] = {
    multihead_attention: (),
    # both read c_attn/c_proj; only BigCode's multi_query/kv_heads flags say how c_attn splits (GPT-2 also requires
    # a Conv1D c_attn, so today the two never meet; the order keeps a Linear-accepting GPT-2 path from shadowing it)
    gpt_bigcode: (gpt2_conv1d,),
    gpt2_conv1d: (),
    # both read query_key_value/dense: Falcon's grouped [KV, G+2, d] and multi-query [H+2, d] rows, read as
    # GPT-NeoX's [H, 3, d], would pair the wrong rows (the one overlap the tiny models show)
    falcon: (interleaved_qkv,),
    interleaved_qkv: (),
    fused_blocks: (),
    codegen: (),
    # separate projections plus position projections that must stack onto the QK pair; the names differ from every
    # separate q/k/v path today, and the order keeps a new path from mapping DeBERTa-v2 without its position terms
    deberta_v2: (separate_qkv,),
    deberta: (),
    # MLA without q_lora_rank has a q_proj and an o_proj but no k_proj/v_proj: today separate q/k/v never matches
    # it; the order keeps a path that accepts a missing k_proj from mapping the latent without its RoPE part
    latent_attention: (separate_qkv,),
    separate_qkv: (),
}


def order_adapters(precedes: dict[Adapter, tuple[Adapter, ...]]) -> tuple[Adapter, ...]:
    """A stable topological order of ``precedes`` (dict order where no constraint applies)."""
    order: list[Adapter] = []
    remaining = list(precedes)
    while remaining:
        blocked = {later for a in remaining for later in precedes[a]}
        ready = [a for a in remaining if a not in blocked]
        if not ready:
            raise ValueError(f"adapter order has a cycle among {[a.__name__ for a in remaining]}")
        order.append(ready[0])
        remaining.remove(ready[0])
    return tuple(order)


ADAPTERS: tuple[Adapter, ...] = order_adapters(PRECEDES)

__all__ = [
    "ADAPTERS",
    "PRECEDES",
    "Adapter",
    "AttentionLayout",
    "DecoupledRope",
    "LayoutContext",
    "Proj",
    "Unmappable",
    "codegen",
    "deberta",
    "deberta_v2",
    "falcon",
    "fused_blocks",
    "gpt2_conv1d",
    "gpt_bigcode",
    "interleaved_qkv",
    "is_lora_layer",
    "latent_attention",
    "multihead_attention",
    "order_adapters",
    "separate_qkv",
    "unwrap_lora",
]
