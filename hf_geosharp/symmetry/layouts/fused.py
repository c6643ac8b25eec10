"""Adapters for fused q/k/v projections: GPT-2's ``Conv1D``, GPTBigCode, Falcon's three layouts, interleaved
``[H, 3, d]`` (GPT-NeoX, BLOOM), ``[Q | K | V]`` blocks (Phi-3, ModernBERT, MPT, vision towers), CodeGen's
model-parallel shards and ``nn.MultiheadAttention``."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .introspect import child_module, find_head_dim, finish_layout
from .layout import AttentionLayout, LayoutContext, Proj, Unmappable, unwrap_lora


def gpt2_conv1d(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPT-2: fused ``c_attn`` Conv1D ``[in, 3E]`` = [Q | K | V] columns (cross-attention: ``q_attn`` + [K | V])."""
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if c_attn is None or c_proj is None or not isinstance(unwrap_lora(c_attn)[0], Conv1D):
        return None
    d = find_head_dim([module], ctx.config)
    fused = ctx.proj(c_attn)
    if getattr(module, "is_cross_attention", False):
        e = fused.out_features // 2
        q, k, v = ctx.proj(module.q_attn), fused.select(slice(0, e)), fused.select(slice(e, 2 * e))
    else:
        e = fused.out_features // 3
        q, k, v = (fused.select(slice(i * e, (i + 1) * e)) for i in range(3))
    return finish_layout(name, "fused Conv1D c_attn", [module], ctx, q, k, v, ctx.proj(c_proj), d)


def falcon(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Falcon ``query_key_value``: grouped ``[KV, G+2, d]`` (new architecture), ``[H+2, d]`` (multi-query) or
    interleaved ``[H, 3, d]``. Read from the live module's flags, not the config defaults (which mislead)."""
    qkv = getattr(module, "query_key_value", None)
    if qkv is None or not hasattr(module, "new_decoder_architecture") or not hasattr(module, "multi_query"):
        return None
    d, n_heads = find_head_dim([module], ctx.config), int(module.num_heads)
    fused = ctx.proj(qkv)
    if module.new_decoder_architecture:
        n_kv = int(module.num_kv_heads)
        rows = torch.arange(fused.out_features).view(n_kv, n_heads // n_kv + 2, d)
        q_rows, k_rows, v_rows = rows[:, :-2], rows[:, -2], rows[:, -1]
        layout = "Falcon grouped [KV, G+2, d]"
    elif module.multi_query:
        rows = torch.arange(fused.out_features).view(n_heads + 2, d)
        q_rows, k_rows, v_rows = rows[:-2], rows[-2], rows[-1]
        layout = "Falcon multi-query [H+2, d]"
    else:
        rows = torch.arange(fused.out_features).view(n_heads, 3, d)
        q_rows, k_rows, v_rows = rows[:, 0], rows[:, 1], rows[:, 2]
        layout = "Falcon interleaved [H, 3, d]"
    q, k, v = (fused.select(r.reshape(-1)) for r in (q_rows, k_rows, v_rows))
    return finish_layout(name, layout, [module], ctx, q, k, v, ctx.proj(module.dense), d)


def interleaved_qkv(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPT-NeoX / BLOOM ``query_key_value``: per head ``[q, k, v]``, i.e. output units ``[H, 3, d]``."""
    qkv, dense = getattr(module, "query_key_value", None), getattr(module, "dense", None)
    if qkv is None or dense is None:
        return None
    d = find_head_dim([module], ctx.config)
    fused = ctx.proj(qkv)
    if fused.out_features % (3 * d):
        raise Unmappable(f"query_key_value has {fused.out_features} units, not a multiple of 3 x head_dim {d}")
    rows = torch.arange(fused.out_features).view(-1, 3, d)
    q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
    return finish_layout(name, "interleaved fused qkv [H, 3, d]", [module], ctx, q, k, v, ctx.proj(dense), d)


# (fused q/k/v, output) child paths whose fused output units are [Q | K | V] blocks
_FUSED_BLOCKS = (("qkv_proj", "o_proj"), ("Wqkv", "Wo"), ("Wqkv", "out_proj"), ("qkv", "proj"), ("qkv", "projection"),
                 ("attention.qkv", "output.dense"), ("att_proj", "out_proj"))


def fused_blocks(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Fused ``[Q (H*d) | K (KV*d) | V (KV*d)]`` projection (Phi-3 ``qkv_proj``, ModernBERT ``Wqkv``, MPT ``Wqkv``,
    the ``qkv``/``proj`` of ViT-style vision towers: Qwen-VL, GLM-4V, SAM, BLIP, TimeSformer, ...)."""
    for qkv_name, o_name in _FUSED_BLOCKS:
        qkv, o_mod = child_module(module, qkv_name), child_module(module, o_name)
        if qkv is None or o_mod is None:
            continue
        if getattr(module, "clip_qkv", None):
            raise Unmappable(f"clip_qkv={module.clip_qkv} clamps q, k and v elementwise, which no GL(h) element "
                             "commutes with; not mapped")
        fused, o = ctx.proj(qkv), ctx.proj(o_mod)
        d = find_head_dim([module], ctx.config, o.weight.shape[1])
        q_units = o.weight.shape[1]
        kv_units = (fused.out_features - q_units) // 2
        q = fused.select(slice(0, q_units))
        k = fused.select(slice(q_units, q_units + kv_units))
        v = fused.select(slice(q_units + kv_units, fused.out_features))
        return finish_layout(name, f"fused blocks {qkv_name} [Q | K | V]", [module], ctx, q, k, v, o, d)
    return None


def multihead_attention(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """``torch.nn.MultiheadAttention``: ``in_proj_weight`` ``[3E, E]`` blocks (or separate q/k/v weights)."""
    if not isinstance(module, nn.MultiheadAttention):
        return None
    e = module.embed_dim
    bias = module.in_proj_bias
    if module._qkv_same_embed_dim:
        fused = ctx.raw(module.in_proj_weight, bias)
        q, k, v = (fused.select(slice(i * e, (i + 1) * e)) for i in range(3))
    else:
        biases = [None] * 3 if bias is None else [ctx.index(bias)[i * e:(i + 1) * e] for i in range(3)]
        shared = () if bias is None else (bias,)
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        q, k, v = (Proj(ctx.index(w), b, (w, *shared)) for w, b in zip(weights, biases))
    extras = {}
    if module.bias_k is not None:
        extras["k_extra"] = Proj(ctx.index(module.bias_k).reshape(e), None, (module.bias_k,))
        extras["v_extra"] = Proj(ctx.index(module.bias_v).reshape(e), None, (module.bias_v,))
    return finish_layout(name, "nn.MultiheadAttention", [module], ctx, q, k, v, ctx.proj(module.out_proj),
                         module.head_dim, **extras)


def gpt_bigcode(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPTBigCode (StarCoder) ``c_attn`` ``nn.Linear``: multi-query ``[Q (H*d) | K (d) | V (d)]``, else per head
    ``[H, 3, d]``. Read from the live module's ``multi_query`` flag."""
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if c_attn is None or c_proj is None or not hasattr(module, "multi_query") or not hasattr(module, "kv_heads"):
        return None
    if getattr(module, "is_cross_attention", False):
        raise Unmappable("GPTBigCode cross-attention splits c_attn into one head's key and value; not mapped")
    d, n_heads = find_head_dim([module], ctx.config), int(module.num_heads)
    fused = ctx.proj(c_attn)
    if module.multi_query:
        e, kv = n_heads * d, int(module.kv_heads) * d
        q, k, v = fused.select(slice(0, e)), fused.select(slice(e, e + kv)), fused.select(slice(e + kv, e + 2 * kv))
        layout = "GPTBigCode multi-query [Q | K | V]"
    else:
        rows = torch.arange(fused.out_features).view(n_heads, 3, d)
        q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
        layout = "GPTBigCode per-head [H, 3, d]"
    return finish_layout(name, layout, [module], ctx, q, k, v, ctx.proj(c_proj), d)


def codegen(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """CodeGen ``qkv_proj``: ``mp_num`` model-parallel shards, each ``[q | v | k]`` of ``H/mp_num`` heads (note the
    order), i.e. output units ``[mp, 3, local]``; heads are numbered shard-major, as ``out_proj`` reads them."""
    qkv, out = getattr(module, "qkv_proj", None), getattr(module, "out_proj", None)
    if qkv is None or out is None or not isinstance(getattr(module, "mp_num", None), int):
        return None
    fused, o = ctx.proj(qkv), ctx.proj(out)
    d = find_head_dim([module], ctx.config, o.weight.shape[1])
    if fused.out_features % (3 * module.mp_num):
        raise Unmappable(f"qkv_proj has {fused.out_features} units, not 3 x mp_num {module.mp_num} shards")
    rows = torch.arange(fused.out_features).view(module.mp_num, 3, -1)
    q, v, k = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
    return finish_layout(name, "CodeGen sharded qkv [mp, q | v | k]", [module], ctx, q, k, v, o, d)
