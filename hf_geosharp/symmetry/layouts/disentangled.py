"""Adapters for DeBERTa's disentangled attention: v2/v3 (separate projections plus position projections) and v1
(a fused ``in_proj`` with separate biases)."""

from __future__ import annotations

import torch
from torch import nn

from .introspect import find_head_dim, finish_layout
from .layout import AttentionLayout, LayoutContext, Proj, Unmappable


def _positions(attn: nn.Module) -> set[str]:
    """DeBERTa's relative-position score terms in use (``c2p``: query x position key, ``p2c``: key x position
    query); none without ``relative_attention``."""
    return set(attn.pos_att_type or ()) & {"c2p", "p2c"} if getattr(attn, "relative_attention", False) else set()


def deberta_v2(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """DeBERTa-v2/v3 disentangled attention: ``self.{query,key,value}_proj`` and ``output.dense``.

    The position terms are ``q_c . (W_pk r + b_pk)`` (c2p) and ``k_c . (W_pq r + b_pq)`` (p2c) with ``r`` a relative
    position embedding; with ``share_att_key`` the position projections are ``W_q``/``W_k`` themselves. Every term
    is ``[u, 1] G H^T [u', 1]^T`` once the position query projection is stacked onto ``G`` and the position key
    projection onto ``H``, so GL(d) still acts per head. p2c makes the key bias visible (``b_k . q_r`` depends on the
    relative position).
    """
    attn, out = getattr(module, "self", None), getattr(module, "output", None)
    if attn is None or out is None or not all(hasattr(attn, a) for a in ("query_proj", "key_proj", "value_proj",
                                                                           "pos_att_type")):
        return None
    d = find_head_dim([attn], ctx.config)
    q, k, v, o = (ctx.proj(m) for m in (attn.query_proj, attn.key_proj, attn.value_proj, out.dense))
    terms = _positions(attn)
    q_more, k_more = [], []
    if terms and not getattr(attn, "share_att_key", False):
        if "p2c" in terms:
            q_more.append(ctx.proj(attn.pos_query_proj))
        if "c2p" in terms:
            k_more.append(ctx.proj(attn.pos_key_proj))
    layout = "DeBERTa-v2 disentangled" + (f" ({'+'.join(sorted(terms))}"
                                          f"{', shared keys' if getattr(attn, 'share_att_key', False) else ''})"
                                          if terms else "")
    visible = "p2c multiplies b_k by the position query" if "p2c" in terms else None
    return finish_layout(name, layout, [module, attn], ctx, q, k, v, o, d, q_more=tuple(q_more), k_more=tuple(k_more),
                         key_bias_visible=visible)


def deberta(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """DeBERTa (v1): per head ``[H, 3, d]`` in ``self.in_proj`` (no bias), separate ``q_bias``/``v_bias``, position
    projections ``pos_proj`` (keys, c2p) and ``pos_q_proj`` (queries, p2c). Talking heads mix the heads' scores, so
    no per-head group survives."""
    attn, out = getattr(module, "self", None), getattr(module, "output", None)
    if attn is None or out is None or not all(hasattr(attn, a) for a in ("in_proj", "q_bias", "v_bias")):
        return None
    if getattr(attn, "head_logits_proj", None) is not None or getattr(attn, "head_weights_proj", None) is not None:
        raise Unmappable("talking heads (head_logits_proj/head_weights_proj) mix the heads' scores and "
                         "probabilities; no per-head GL(d) acts")
    d = find_head_dim([attn], ctx.config)
    fused = ctx.proj(attn.in_proj)
    rows = torch.arange(fused.out_features).view(-1, 3, d)
    q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
    q = Proj(q.weight, ctx.index(attn.q_bias), (attn.in_proj.weight, attn.q_bias), q.lora)
    v = Proj(v.weight, ctx.index(attn.v_bias), (attn.in_proj.weight, attn.v_bias), v.lora)
    terms = _positions(attn)
    q_more = (ctx.proj(attn.pos_q_proj),) if "p2c" in terms else ()
    k_more = (ctx.proj(attn.pos_proj),) if "c2p" in terms else ()
    layout = "DeBERTa in_proj [H, 3, d]" + (f" ({'+'.join(sorted(terms))})" if terms else "")
    return finish_layout(name, layout, [module, attn], ctx, q, k, v, ctx.proj(out.dense), d, q_more=q_more,
                         k_more=k_more)
