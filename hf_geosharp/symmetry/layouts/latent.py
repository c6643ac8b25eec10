"""The adapter for multi-head latent attention (DeepSeek-V2/V3 and the models that reuse it): per-head GL on the
non-rotated query/key blocks and on values/outputs, and the RoPE commutant on the decoupled RoPE part, whose key
is shared by all heads. The derivation is in docs/symmetries.md."""

from __future__ import annotations

import torch
from torch import nn

from .introspect import finish_layout, rotary_helpers, source
from .layout import AttentionLayout, DecoupledRope, LayoutContext, Unmappable

# parameters of an MLA module that the pairs leave alone, with why the per-head groups still act: the latent
# down-projections and their RMSNorms sit before q_b_proj/kv_b_proj's input columns (the pairs use their rows);
# a DSA indexer picks the attended keys from the query latent and the hidden states, never from q_b/kv_b
_LATENT_CHILDREN = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm", "indexer")
_INTERLEAVED_WORDS = ("::2]", "view_as_complex", "rotate_every_two", "rotate_pairwise")


def latent_attention(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """``q_proj`` or ``q_a_proj -> RMSNorm -> q_b_proj`` (per head ``[nope | rope]``), ``kv_a_proj_with_mqa``
    (``[latent | shared rotated key]``), ``kv_a_layernorm``, ``kv_b_proj`` (per head ``[k_nope | v]``), ``o_proj``."""
    kv_a, kv_b, o_mod = (getattr(module, n, None) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
    if kv_a is None or kv_b is None or o_mod is None:
        return None
    q_mod = getattr(module, "q_b_proj", None) or getattr(module, "q_proj", None)
    if q_mod is None:
        raise Unmappable("latent attention without q_b_proj or q_proj")
    config = getattr(module, "config", None) or ctx.config
    nope, rot, dv, rank = (_dim(module, config, a) for a in
                           ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    q_full, kv_b_full, kv_a_full = ctx.proj(q_mod), ctx.proj(kv_b), ctx.proj(kv_a)
    n_heads = q_full.out_features // (nope + rot)
    q_rows = torch.arange(q_full.out_features).view(n_heads, nope + rot)
    kv_rows = torch.arange(kv_b_full.out_features).view(-1, nope + dv)
    if kv_rows.shape[0] != n_heads or kv_a_full.out_features != rank + rot:
        raise Unmappable(f"kv_b_proj has {kv_rows.shape[0]} heads and kv_a_proj_with_mqa {kv_a_full.out_features} "
                         f"units, but q has {n_heads} heads and kv_lora_rank + qk_rope_head_dim = {rank + rot}")
    q, q_rot = (q_full.select(r.reshape(-1)) for r in (q_rows[:, :nope], q_rows[:, nope:]))
    k, v = (kv_b_full.select(r.reshape(-1)) for r in (kv_rows[:, :nope], kv_rows[:, nope:]))
    rope_part = None if rot == 0 else DecoupledRope(q_rot, kv_a_full.select(slice(rank, rank + rot)),
                                                    _rope_of(module, config, rot))
    latent = tuple(p for child in _LATENT_CHILDREN if isinstance(getattr(module, child, None), nn.Module)
                   for p in getattr(module, child).parameters())
    return finish_layout(name, "multi-head latent attention", [module], ctx, q, k, v, ctx.proj(o_mod), nope,
                         v_head_dim=dv, rope_part=rope_part, latent=latent)


def _dim(module: nn.Module, config: object, attr: str) -> int:
    value = getattr(module, attr, None)
    value = getattr(config, attr, None) if value is None else value
    if not isinstance(value, int) or value < 0:
        raise Unmappable(f"latent attention without an integer {attr}")
    return value


def _rope_of(module: nn.Module, config: object, rot: int) -> tuple[int, bool] | None:
    """``(r, interleaved)`` for the decoupled RoPE slices, or ``None`` where the forward rotates nothing (Kimi's
    NoPE layers). A forward that switches on ``rope_interleave`` follows the config; otherwise the rotary helpers it
    calls say the pairing (``x[..., 0::2]`` and ``view_as_complex(x.reshape(..., -1, 2))`` pair ``(2j, 2j+1)``)."""
    forward = source(type(module).forward)
    if not any(word in forward for word in ("rotary", "rotate", "rope_emb", "freqs_cis")):
        return None
    if rot <= 0 or rot % 2:
        raise Unmappable(f"qk_rope_head_dim {rot} is not even")
    if "rope_interleave" in forward:
        return rot, bool(getattr(config, "rope_interleave", False))
    helpers = rotary_helpers(type(module))
    return rot, any(word in src for src in helpers for word in _INTERLEAVED_WORDS)
