"""The adapter for separate q, k, v and o projections (BERT, DistilBERT, ALBERT, Llama, CLIP, Phi, T5, ...)."""

from __future__ import annotations

from torch import nn

from .introspect import child_module, find_head_dim, finish_layout
from .layout import AttentionLayout, LayoutContext

# (q, k, v, o) child paths of separate projections, per family; o's input columns are the heads
_SEPARATE = (
    ("self.query", "self.key", "self.value", "output.dense"),  # BERT, RoBERTa, ELECTRA, ...
    ("query", "key", "value", "dense"),  # ALBERT
    ("q_lin", "k_lin", "v_lin", "out_lin"),  # DistilBERT
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama, Mistral, Qwen2/3, Gemma, OLMo2, ViT (5.x)
    ("q_proj", "k_proj", "v_proj", "out_proj"),  # CLIP, OPT, BART, GPT-J, GPT-Neo
    ("q_proj", "k_proj", "v_proj", "dense"),  # Phi
    ("q", "k", "v", "o"),  # T5, MPNet
    ("attention.query", "attention.key", "attention.value", "output.dense"),  # ViT-style (Data2Vec, DPT, Yolos, ...)
    ("query", "key", "value", "output"),  # Pix2Struct, Kosmos-2.5 vision
    ("query", "key", "value", "proj"),  # PVT-v2, V-JEPA 2
    ("Wq", "Wk", "Wv", "dense"),  # CTRL
    ("query_proj", "key_proj", "value_proj", "out_proj"),  # ProphetNet
    ("q_proj", "k_proj", "v_proj", "projection_layer"),  # InternVL, Janus vision
    ("q_proj", "k_proj", "v_proj", "proj"),  # Kimi-K2.5 vision, X-CLIP cross-attention
    ("q_proj", "k_proj", "v_proj", "Wo"),  # ModernBERT decoder
    ("q", "k", "v", "proj"),  # Qwen2.5-Omni vision
    ("to_q", "to_k", "to_v", "to_out.0"),  # DiT blocks
    ("linear_q", "linear_k", "linear_v", "linear_out"),  # conformers (without relative positions)
)


def separate_qkv(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Separate q, k, v and o projections (self- and cross-attention alike)."""
    for paths in _SEPARATE:
        children = [child_module(module, p) for p in paths]
        if any(c is None for c in children):
            continue
        q, k, v, o = (ctx.proj(c) for c in children)
        q_parent = paths[0].rpartition(".")[0]
        holders = [module] + ([module.get_submodule(q_parent)] if q_parent else [])
        head_dim = find_head_dim(holders, ctx.config, o.weight.shape[1])
        return finish_layout(name, "separate q/k/v", holders, ctx, q, k, v, o, head_dim)
    return None
