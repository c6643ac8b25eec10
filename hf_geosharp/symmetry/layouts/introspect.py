"""What adapters read off a live attention module besides its projections: head size, RoPE (rotary dimension and
pairing, from the forward's source), qk-norm, and parameters no projection explains; :func:`finish_layout` applies
them all to a recognised layout."""

from __future__ import annotations

import inspect
import re
import sys

import torch
from torch import nn

from .layout import AttentionLayout, LayoutContext, Proj, Unmappable

_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
_N_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "heads", "n_head")
_QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_ln", "k_ln",
                  "qk_norm")
# parameters inside an attention module that provably leave the GL action alone: they add to the scores
# independently of q and k (relative-position buckets) or to the softmax normaliser (attention sinks)
# (Swin's bias table likewise); a residual LayerNorm named ``LayerNorm`` (ALBERT) acts after the output projection
_SAFE_EXTRAS = {"relative_attention_bias": "relative-position score bias", "sinks": "attention sinks",
                "relative_position_bias_table": "relative-position score bias table",
                "LayerNorm": "residual LayerNorm after the output projection (ALBERT)"}
# parameters that sit inside the score or between the heads and the output, with the operation that breaks GL(h)
_BREAKING_EXTRAS = {
    name: why for names, why in (
        (("rel_pos_h", "rel_pos_w"), "decomposed relative-position tables multiplied by q (SAM's q . R_h + q . R_w): "
                                     "the tables would have to move with the key side of the group"),
        (("pos_bias_u", "pos_bias_v", "linear_pos"), "Transformer-XL relative positions ((q + u) . k + (q + v) . "
                                                     "W_pos p): u, v and W_pos would have to move with the pair"),
        (("distance_embedding",), "relative-position key embeddings multiplied by q (Shaw et al.: q . r_(i-j)): the "
                                  "embedding table would have to move with the key side of the group"),
        (("attn_sub_norm",), "a norm on the heads' output before the output projection"),
    ) for name in names
}
_ROPE_WORDS = ("rotary", "rotate_half", "rotate_every_two", "apply_rope")


def find_head_dim(holders: list[nn.Module], config: object, width: int | None = None) -> int:
    """The head size the modules store (under any of the usual names), else ``width`` (the output projection's
    input units) over the head count the modules store, else the config's."""
    for holder in holders:
        for attr in _HEAD_DIM_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    for holder in holders:
        for attr in _N_HEADS_ATTRS:
            heads = getattr(holder, attr, None)
            if isinstance(heads, int) and heads > 0 and width and width % heads == 0:
                return width // heads
    for attr in ("head_dim", "d_kv"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise Unmappable("cannot determine head_dim from the module's attributes or its config")


def _config_of(holders: list[nn.Module], ctx: LayoutContext) -> object:
    for holder in holders:
        if getattr(holder, "config", None) is not None:
            return holder.config
    return ctx.config


def source(obj: object) -> str:
    """The source of ``obj``, or an empty string where it has none (built-ins, dynamic classes)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _rope(holders: list[nn.Module], config: object, head_dim: int) -> tuple[int, bool] | None:
    """``(rotary_dim, interleaved)`` if the module applies rotary embeddings to q and k, else ``None``.

    RoPE use is read from the forward code of the live module classes (HF attention forwards call
    ``apply_rotary_pos_emb``); ALiBi configs (Falcon) build a rotary module they never use, hence the config check.
    Missing RoPE would be a wrong map, an extra one only a smaller group, so any mention counts.
    """
    if getattr(config, "alibi", False):
        return None
    classes = {type(h) for h in holders}
    if not any(word in source(cls.forward) for cls in classes for word in _ROPE_WORDS):
        return None
    rotary_dim = _rotary_dim(holders, config, head_dim)
    # pairs (2j, 2j+1) instead of rotate_half's (j, j + r/2): GPT-J, RoFormer, Cohere, gpt-oss, SAM3's 2-D RoPE
    sources = [src for cls in classes for src in [source(cls), *rotary_helpers(cls)]]
    interleaved = any(word in src for src in sources for word in ("rotate_every_two", "rotate_pairwise", "::2]"))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise Unmappable(f"rotary dimension {rotary_dim} is not even and within head_dim {head_dim}")
    return rotary_dim, interleaved


def rotary_helpers(cls: type, depth: int = 3) -> list[str]:
    """Sources of the rotary helpers the class's forward calls, followed through the helpers they call.

    Only functions whose name mentions rot/rope are followed, so a file that holds a second RoPE style for another
    module (a vision tower) does not leak into this module's pairing.
    """
    namespace = vars(sys.modules[cls.__module__])
    seen: dict[str, str] = {}
    frontier = [source(cls.forward)]
    for _ in range(depth):
        called = {n for src in frontier for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", src)}
        new = [n for n in called if n not in seen and ("rot" in n.lower() or "rope" in n.lower())
               and inspect.isfunction(namespace.get(n))]
        frontier = [seen.setdefault(n, source(namespace[n])) for n in new]
    return list(seen.values())


def _rotary_dim(holders: list[nn.Module], config: object, head_dim: int) -> int:
    for holder in holders:
        for attr in ("rotary_ndims", "rotary_dim", "rotary_emb_dim"):
            if hasattr(holder, attr):
                value = getattr(holder, attr)
                return head_dim if value is None else int(value)
    params = getattr(config, "rope_parameters", None) or {}
    per_layer_type = [v for v in params.values() if isinstance(v, dict)]
    default = getattr(config, "partial_rotary_factor", None) or 1.0
    factors = {float(p.get("partial_rotary_factor") or default) for p in per_layer_type or [params]}
    if len(factors) != 1:
        raise Unmappable(f"layer types use different partial rotary factors {sorted(factors)}")
    return int(head_dim * factors.pop())


def _called_sources(cls: type) -> list[str]:
    """The forward's source and the sources of the module-level functions it calls (one level)."""
    namespace = vars(sys.modules[cls.__module__])
    forward = source(cls.forward)
    called = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", forward))
    return [forward] + [source(namespace[n]) for n in sorted(called) if inspect.isfunction(namespace.get(n))]


def _refuse_pooled_queries(holders: list[nn.Module]) -> None:
    """Refuse a forward that max-pools q, k or v (Hiera's mask-unit attention, SAM-2's query pooling): a max over
    positions taken coordinate by coordinate does not commute with a change of basis of the head."""
    for holder in holders:
        pooled = any(isinstance(m, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)) for m in holder.children())
        if pooled or any(re.search(r"max_pool|\.max\(dim=|\.amax\(", src) for src in _called_sources(type(holder))):
            raise Unmappable("the forward max-pools the queries (or keys/values) over positions: a coordinatewise "
                             "max does not commute with GL(h), so nothing is mapped")


def _refuse_other_norms(holders: list[nn.Module]) -> None:
    """Refuse a norm child that is not a qk-norm (EmbeddingGemma-2's parameter-free ``v_norm`` on the values): a norm
    without parameters escapes the unexplained-parameter check, and normalising v or the heads' output breaks VO."""
    for holder in holders:
        for name, child in holder.named_children():
            if "norm" in type(child).__name__.lower() and name not in _QK_NORM_NAMES and name not in _SAFE_EXTRAS:
                raise Unmappable(f"{name} ({type(child).__name__}) normalises the values or the heads' output, which "
                                 "breaks GL(h) on VO; not mapped")


def _qk_norm(holders: list[nn.Module], head_dim: int) -> str | None:
    """Why QK is not GL-symmetric when q/k are normalised, or ``None`` without qk-norm."""
    if any(re.search(r"\bnormalize\(", source(type(h).forward)) for h in holders):
        raise Unmappable("the forward calls normalize(...) on q/k or on the heads' output (cosine attention, "
                         "YOSO); a parameter-free normalisation breaks GL(h), so nothing is mapped")
    for holder in holders:
        for name in _QK_NORM_NAMES:
            norm = getattr(holder, name, None)
            if not isinstance(norm, nn.Module):
                continue
            weight = getattr(norm, "weight", None)
            width = weight.numel() if isinstance(weight, torch.Tensor) else None
            if width is None:
                return (f"qk-norm ({type(norm).__name__} on q/k): normalising q and k breaks the GL(h) symmetry of "
                        "the QK pair, so W_q and W_k are treated elementwise; VO is mapped")
            if width == head_dim:
                return (f"per-head qk-norm ({type(norm).__name__} on each head's q/k): normalising q and k breaks "
                        "the GL(h) symmetry of the QK pair, so W_q and W_k are treated elementwise; VO is mapped")
            return (f"full-width qk-norm ({type(norm).__name__} over all heads' q/k): it couples heads and breaks the "
                    "GL(h) symmetry of the QK pair, so W_q and W_k are treated elementwise; VO is mapped")
    return None


def finish_layout(name: str, layout: str, holders: list[nn.Module], ctx: LayoutContext,
                  q: Proj, k: Proj, v: Proj, o: Proj, head_dim: int, **extra: object) -> AttentionLayout:
    """The checked layout of recognised projections, with head counts, RoPE and qk-norm read off ``holders`` (the
    attention module and the one holding q, if that is a child); every adapter ends here."""
    config = _config_of(holders, ctx)
    n_heads = o.weight.shape[1] // (extra.get("v_head_dim") or head_dim)
    n_kv = k.out_features // head_dim
    result = AttentionLayout(name, layout, q, k, v, o, n_heads, n_kv, head_dim, **extra)
    result.validate()
    # with a decoupled RoPE part (MLA) the rotation acts there, not on the head_dim block of q and k
    result.rope = None if result.rope_part is not None else _rope(holders, config, head_dim)
    result.rope_on_values = result.rope is not None and any(getattr(h, "rotary_value", False) for h in holders)
    result.qk_norm = _qk_norm(holders, head_dim)
    _refuse_pooled_queries(holders)
    if result.rope_part is None:  # MLA's latent RMSNorms sit before the pairs (docs/symmetries.md)
        _refuse_other_norms(holders)
    _check_accounted(holders[-1], result)
    return result


def _check_accounted(holder: nn.Module, lay: AttentionLayout) -> None:
    """Refuse a layout whose attention module has parameters that no projection explains.

    Such parameters (a norm on the heads' output, a gate, differential-attention lambdas, a dynamic mask computed
    from the values) may act between the projections and break the group action; a fallback is safe, a wrong map
    is not. QK norms are handled by :func:`_qk_norm`, and :data:`_SAFE_EXTRAS` are known to leave the action alone.
    """
    rope_part = () if lay.rope_part is None else (lay.rope_part.q, lay.rope_part.k)
    known = {id(p) for proj in (lay.q, lay.k, lay.v, lay.o, lay.k_extra, lay.v_extra, *lay.q_more, *lay.k_more,
                                *rope_part) if proj is not None for p in proj.params}
    known |= {id(p) for p in lay.latent}
    for name in _QK_NORM_NAMES:
        norm = getattr(holder, name, None)
        if isinstance(norm, nn.Module):
            known |= {id(p) for p in norm.parameters()}
    unknown = [n for n, p in holder.named_parameters() if id(p) not in known
               and n.split(".")[0] not in _SAFE_EXTRAS
               and not any(part == "base_layer" or part.startswith("lora_") for part in n.split("."))]  # PEFT
    if unknown:
        shown = ", ".join(unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        known_why = [_BREAKING_EXTRAS[n.split(".")[0]] for n in unknown if n.split(".")[0] in _BREAKING_EXTRAS]
        if known_why and len(known_why) == len(unknown):
            why = "; ".join(dict.fromkeys(known_why))
            raise Unmappable(f"{why} ({shown}); not mapped")
        raise Unmappable(f"parameters no projection explains ({shown}) may act between q/k/v and the output "
                         "(a norm, a gate, a mask from the values), so the group action is not proven; not mapped")


def child_module(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path``, or ``None`` if there is none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
