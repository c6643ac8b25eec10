"""Adapters: recognise one attention layout in a live module and describe it as index maps.

Every adapter looks at a module of the instantiated model (its class, children and attributes; never checkpoint
keys) and either returns ``None`` (not this layout), an :class:`AttentionLayout` (q, k, v and o projections as flat
index tensors in ``nn.Linear`` orientation, plus heads, RoPE and qk-norm), or raises :class:`Unmappable` when it
recognises the layout but cannot map it safely. Turning a layout into GL(h) pairs is done once, in
:mod:`hf_geosharp.symmetry.mapping`, for all layouts alike.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


class Unmappable(Exception):
    """The module is an attention layout we know, but this instance cannot be mapped; the message says why."""


@dataclass
class Proj:
    """A projection in ``nn.Linear`` orientation: ``weight [out, in]`` and ``bias [out]`` as flat indices.

    ``params`` are the real parameters behind the indices (for ``params="trainable"``); ``lora`` says that a PEFT
    LoRA adapter wraps the projection (its base weight then is not the whole story).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    params: tuple[nn.Parameter, ...]
    lora: bool = False

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def select(self, rows: torch.Tensor | slice) -> Proj:
        """The sub-projection made of the given output units (fused layouts)."""
        bias = None if self.bias is None else self.bias[rows]
        return Proj(self.weight[rows], bias, self.params, self.lora)


@dataclass
class AttentionLayout:
    """One attention module as projections: head ``i`` owns q rows and o columns ``[i*d, (i+1)*d)``.

    KV head ``g`` owns k and v rows ``[g*d, (g+1)*d)`` and serves query heads ``g*H/KV ... (g+1)*H/KV - 1``
    (``repeat_kv`` order). ``rope`` is ``(rotary_dim, interleaved)``; ``rope_on_values`` says that values are
    rotated too (RoFormer ``rotary_value``). ``k_extra``/``v_extra`` are learned extra key/value tokens
    (``add_bias_kv``); their ``weight`` is a vector ``[KV*d]``. ``q_more``/``k_more`` are further projections whose
    head slices meet the keys/queries in a score term (DeBERTa's relative-position projections): their rows are
    stacked onto the QK pair's ``G``/``H``. ``key_bias_visible`` says why the key bias is seen (``None``: it is not).
    """

    module: str
    layout: str
    q: Proj
    k: Proj
    v: Proj
    o: Proj
    n_heads: int
    n_kv: int
    head_dim: int
    rope: tuple[int, bool] | None = None
    rope_on_values: bool = False
    qk_norm: str | None = None
    k_extra: Proj | None = None
    v_extra: Proj | None = None
    q_more: tuple[Proj, ...] = ()
    k_more: tuple[Proj, ...] = ()
    key_bias_visible: str | None = None

    def validate(self) -> None:
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        if d <= 0 or h <= 0 or kv <= 0 or h % kv:
            raise Unmappable(f"inconsistent head counts: {h} query heads, {kv} KV heads, head_dim {d}")
        expected = {"q": (self.q.out_features, h * d), "k": (self.k.out_features, kv * d),
                    "v": (self.v.out_features, kv * d), "o input": (self.o.weight.shape[1], h * d)}
        expected |= {f"extra q {i}": (p.out_features, h * d) for i, p in enumerate(self.q_more)}
        expected |= {f"extra k {i}": (p.out_features, kv * d) for i, p in enumerate(self.k_more)}
        for what, (got, want) in expected.items():
            if got != want:
                raise Unmappable(f"{what} has {got} units but {h} heads x {kv} KV heads x head_dim {d} need {want}")


class LayoutContext:
    """What adapters need besides the module: flat indices of parameters and the model's config."""

    def __init__(self, model: nn.Module, index_of: Callable[[str], torch.Tensor]) -> None:
        self.config = getattr(model, "config", None)
        self._index_of = index_of
        self._names = {}
        for name, p in model.named_parameters():
            self._names.setdefault(id(p), name)

    def index(self, param: nn.Parameter) -> torch.Tensor:
        return self._index_of(self._names[id(param)])

    def proj(self, module: nn.Module) -> Proj:
        """A ``Linear``/``Conv1D`` (possibly LoRA-wrapped) as a :class:`Proj` in ``nn.Linear`` orientation."""
        base, lora = unwrap_lora(module)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise Unmappable(f"projection {type(base).__name__} has no 2-D weight")
        w_idx = self.index(weight)
        if isinstance(base, Conv1D):  # Conv1D stores [in, out]
            w_idx = w_idx.T
        bias = getattr(base, "bias", None)
        b_idx = self.index(bias) if isinstance(bias, nn.Parameter) else None
        params = (weight,) if b_idx is None else (weight, bias)
        return Proj(w_idx, b_idx, params, lora)

    def raw(self, weight: nn.Parameter, bias: nn.Parameter | None) -> Proj:
        """A bare weight (already ``[out, in]``) and bias, e.g. ``nn.MultiheadAttention.in_proj_weight``."""
        b_idx = None if bias is None else self.index(bias)
        return Proj(self.index(weight), b_idx, (weight,) if bias is None else (weight, bias))


def unwrap_lora(module: nn.Module) -> tuple[nn.Module, bool]:
    """The base layer under PEFT wrappers, and whether a LoRA adapter is attached on the way."""
    lora = False
    while hasattr(module, "base_layer"):
        lora = lora or is_lora_layer(module)
        module = module.base_layer
    return module, lora


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer with at least one adapter (detected structurally, without importing peft)."""
    for a_name, b_name in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
        a, b = getattr(module, a_name, None), getattr(module, b_name, None)
        if isinstance(a, (nn.ModuleDict, nn.ParameterDict)) and isinstance(b, type(a)) and len(a) > 0:
            return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# introspection helpers
# ---------------------------------------------------------------------------------------------------------------

_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")
_QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_ln", "k_ln",
                  "qk_norm")
# parameters inside an attention module that provably leave the GL action alone: they add to the scores
# independently of q and k (relative-position buckets) or to the softmax normaliser (attention sinks)
# (Swin's bias table likewise); a residual LayerNorm named ``LayerNorm`` (ALBERT) acts after the output projection
_SAFE_EXTRAS = {"relative_attention_bias": "relative-position score bias", "sinks": "attention sinks",
                "relative_position_bias_table": "relative-position score bias table",
                "LayerNorm": "residual LayerNorm after the output projection (ALBERT)"}
_ROPE_WORDS = ("rotary", "rotate_half", "rotate_every_two", "apply_rope")


def _head_dim(holders: list[nn.Module], config: object) -> int:
    for holder in holders:
        for attr in _HEAD_DIM_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and value > 0:
                return value
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


def _source(obj: object) -> str:
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
    if not any(word in _source(cls.forward) for cls in classes for word in _ROPE_WORDS):
        return None
    rotary_dim = _rotary_dim(holders, config, head_dim)
    # pairs (2j, 2j+1) instead of rotate_half's (j, j + r/2): GPT-J, RoFormer, Cohere, gpt-oss, SAM3's 2-D RoPE
    sources = [src for cls in classes for src in [_source(cls), *_rotary_helpers(cls)]]
    interleaved = any(word in src for src in sources for word in ("rotate_every_two", "rotate_pairwise", "::2]"))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise Unmappable(f"rotary dimension {rotary_dim} is not even and within head_dim {head_dim}")
    return rotary_dim, interleaved


def _rotary_helpers(cls: type, depth: int = 3) -> list[str]:
    """Sources of the rotary helpers the class's forward calls, followed through the helpers they call.

    Only functions whose name mentions rot/rope are followed, so a file that holds a second RoPE style for another
    module (a vision tower) does not leak into this module's pairing.
    """
    namespace = vars(sys.modules[cls.__module__])
    seen: dict[str, str] = {}
    frontier = [_source(cls.forward)]
    for _ in range(depth):
        called = {n for src in frontier for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", src)}
        new = [n for n in called if n not in seen and ("rot" in n.lower() or "rope" in n.lower())
               and inspect.isfunction(namespace.get(n))]
        frontier = [seen.setdefault(n, _source(namespace[n])) for n in new]
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


def _qk_norm(holders: list[nn.Module], head_dim: int) -> str | None:
    """Why QK is not GL-symmetric when q/k are normalised, or ``None`` without qk-norm."""
    if any(re.search(r"\bnormalize\(", _source(type(h).forward)) for h in holders):
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


def _finish(name: str, layout: str, holders: list[nn.Module], ctx: LayoutContext,
            q: Proj, k: Proj, v: Proj, o: Proj, head_dim: int, **extra: object) -> AttentionLayout:
    config = _config_of(holders, ctx)
    n_heads = o.weight.shape[1] // head_dim
    n_kv = k.out_features // head_dim
    result = AttentionLayout(name, layout, q, k, v, o, n_heads, n_kv, head_dim, **extra)
    result.validate()
    result.rope = _rope(holders, config, head_dim)
    result.rope_on_values = result.rope is not None and any(getattr(h, "rotary_value", False) for h in holders)
    result.qk_norm = _qk_norm(holders, head_dim)
    _check_accounted(holders[-1], result)
    return result


def _check_accounted(holder: nn.Module, lay: AttentionLayout) -> None:
    """Refuse a layout whose attention module has parameters that no projection explains.

    Such parameters (a norm on the heads' output, a gate, differential-attention lambdas, a dynamic mask computed
    from the values) may act between the projections and break the group action; a fallback is safe, a wrong map
    is not. QK norms are handled by :func:`_qk_norm`, and :data:`_SAFE_EXTRAS` are known to leave the action alone.
    """
    known = {id(p) for proj in (lay.q, lay.k, lay.v, lay.o, lay.k_extra, lay.v_extra, *lay.q_more, *lay.k_more)
             if proj is not None for p in proj.params}
    for name in _QK_NORM_NAMES:
        norm = getattr(holder, name, None)
        if isinstance(norm, nn.Module):
            known |= {id(p) for p in norm.parameters()}
    unknown = [n for n, p in holder.named_parameters() if id(p) not in known
               and n.split(".")[0] not in _SAFE_EXTRAS
               and not any(part == "base_layer" or part.startswith("lora_") for part in n.split("."))]  # PEFT
    if unknown:
        shown = ", ".join(unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        raise Unmappable(f"parameters no projection explains ({shown}) may act between q/k/v and the output "
                         "(a norm, a gate, a mask from the values), so the group action is not proven; not mapped")


def _child(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# adapters
# ---------------------------------------------------------------------------------------------------------------

# (q, k, v, o) child paths of separate projections, per family; o's input columns are the heads
_SEPARATE = (
    ("self.query", "self.key", "self.value", "output.dense"),  # BERT, RoBERTa, ELECTRA, ...
    ("query", "key", "value", "dense"),  # ALBERT
    ("q_lin", "k_lin", "v_lin", "out_lin"),  # DistilBERT
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama, Mistral, Qwen2/3, Gemma, OLMo2, ViT (5.x)
    ("q_proj", "k_proj", "v_proj", "out_proj"),  # CLIP, OPT, BART, GPT-J, GPT-Neo
    ("q_proj", "k_proj", "v_proj", "dense"),  # Phi
    ("q", "k", "v", "o"),  # T5, MPNet
)


def separate_qkv(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Separate q, k, v and o projections (self- and cross-attention alike)."""
    for paths in _SEPARATE:
        children = [_child(module, p) for p in paths]
        if any(c is None for c in children):
            continue
        q, k, v, o = (ctx.proj(c) for c in children)
        q_parent = paths[0].rpartition(".")[0]
        holders = [module] + ([module.get_submodule(q_parent)] if q_parent else [])
        return _finish(name, "separate q/k/v", holders, ctx, q, k, v, o, _head_dim(holders, ctx.config))
    return None


def gpt2_conv1d(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPT-2: fused ``c_attn`` Conv1D ``[in, 3E]`` = [Q | K | V] columns (cross-attention: ``q_attn`` + [K | V])."""
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if c_attn is None or c_proj is None or not isinstance(unwrap_lora(c_attn)[0], Conv1D):
        return None
    d = _head_dim([module], ctx.config)
    fused = ctx.proj(c_attn)
    if getattr(module, "is_cross_attention", False):
        e = fused.out_features // 2
        q, k, v = ctx.proj(module.q_attn), fused.select(slice(0, e)), fused.select(slice(e, 2 * e))
    else:
        e = fused.out_features // 3
        q, k, v = (fused.select(slice(i * e, (i + 1) * e)) for i in range(3))
    return _finish(name, "fused Conv1D c_attn", [module], ctx, q, k, v, ctx.proj(c_proj), d)


def falcon(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Falcon ``query_key_value``: grouped ``[KV, G+2, d]`` (new architecture), ``[H+2, d]`` (multi-query) or
    interleaved ``[H, 3, d]``. Read from the live module's flags, not the config defaults (which mislead)."""
    qkv = getattr(module, "query_key_value", None)
    if qkv is None or not hasattr(module, "new_decoder_architecture") or not hasattr(module, "multi_query"):
        return None
    d, n_heads = _head_dim([module], ctx.config), int(module.num_heads)
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
    return _finish(name, layout, [module], ctx, q, k, v, ctx.proj(module.dense), d)


def interleaved_qkv(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPT-NeoX / BLOOM ``query_key_value``: per head ``[q, k, v]``, i.e. output units ``[H, 3, d]``."""
    qkv, dense = getattr(module, "query_key_value", None), getattr(module, "dense", None)
    if qkv is None or dense is None:
        return None
    d = _head_dim([module], ctx.config)
    fused = ctx.proj(qkv)
    if fused.out_features % (3 * d):
        raise Unmappable(f"query_key_value has {fused.out_features} units, not a multiple of 3 x head_dim {d}")
    rows = torch.arange(fused.out_features).view(-1, 3, d)
    q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
    return _finish(name, "interleaved fused qkv [H, 3, d]", [module], ctx, q, k, v, ctx.proj(dense), d)


def fused_blocks(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """Fused ``[Q (H*d) | K (KV*d) | V (KV*d)]`` projection (Phi-3 ``qkv_proj``, ModernBERT ``Wqkv``)."""
    for qkv_name, o_name in (("qkv_proj", "o_proj"), ("Wqkv", "Wo")):
        qkv, o_mod = getattr(module, qkv_name, None), getattr(module, o_name, None)
        if qkv is None or o_mod is None:
            continue
        d = _head_dim([module], ctx.config)
        fused, o = ctx.proj(qkv), ctx.proj(o_mod)
        q_units = o.weight.shape[1]
        kv_units = (fused.out_features - q_units) // 2
        q = fused.select(slice(0, q_units))
        k = fused.select(slice(q_units, q_units + kv_units))
        v = fused.select(slice(q_units + kv_units, fused.out_features))
        return _finish(name, f"fused blocks {qkv_name} [Q | K | V]", [module], ctx, q, k, v, o, d)
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
    return _finish(name, "nn.MultiheadAttention", [module], ctx, q, k, v, ctx.proj(module.out_proj),
                   module.head_dim, **extras)


def gpt_bigcode(name: str, module: nn.Module, ctx: LayoutContext) -> AttentionLayout | None:
    """GPTBigCode (StarCoder) ``c_attn`` ``nn.Linear``: multi-query ``[Q (H*d) | K (d) | V (d)]``, else per head
    ``[H, 3, d]``. Read from the live module's ``multi_query`` flag."""
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if c_attn is None or c_proj is None or not hasattr(module, "multi_query") or not hasattr(module, "kv_heads"):
        return None
    if getattr(module, "is_cross_attention", False):
        raise Unmappable("GPTBigCode cross-attention splits c_attn into one head's key and value; not mapped")
    d, n_heads = _head_dim([module], ctx.config), int(module.num_heads)
    fused = ctx.proj(c_attn)
    if module.multi_query:
        e, kv = n_heads * d, int(module.kv_heads) * d
        q, k, v = fused.select(slice(0, e)), fused.select(slice(e, e + kv)), fused.select(slice(e + kv, e + 2 * kv))
        layout = "GPTBigCode multi-query [Q | K | V]"
    else:
        rows = torch.arange(fused.out_features).view(n_heads, 3, d)
        q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
        layout = "GPTBigCode per-head [H, 3, d]"
    return _finish(name, layout, [module], ctx, q, k, v, ctx.proj(c_proj), d)


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
    d = _head_dim([attn], ctx.config)
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
    return _finish(name, layout, [module, attn], ctx, q, k, v, o, d, q_more=tuple(q_more), k_more=tuple(k_more),
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
    d = _head_dim([attn], ctx.config)
    fused = ctx.proj(attn.in_proj)
    rows = torch.arange(fused.out_features).view(-1, 3, d)
    q, k, v = (fused.select(rows[:, i].reshape(-1)) for i in range(3))
    q = Proj(q.weight, ctx.index(attn.q_bias), (attn.in_proj.weight, attn.q_bias), q.lora)
    v = Proj(v.weight, ctx.index(attn.v_bias), (attn.in_proj.weight, attn.v_bias), v.lora)
    terms = _positions(attn)
    q_more = (ctx.proj(attn.pos_q_proj),) if "p2c" in terms else ()
    k_more = (ctx.proj(attn.pos_proj),) if "c2p" in terms else ()
    layout = "DeBERTa in_proj [H, 3, d]" + (f" ({'+'.join(sorted(terms))})" if terms else "")
    return _finish(name, layout, [module, attn], ctx, q, k, v, ctx.proj(out.dense), d, q_more=q_more, k_more=k_more)


Adapter = Callable[[str, nn.Module, LayoutContext], "AttentionLayout | None"]

# adapter -> the adapters it must be tried before, because it recognises a special case of their layout (the known
# overlaps; tests/test_symmetry_mapping.py checks them); order_adapters() derives the order, dict order otherwise
PRECEDES: dict[Adapter, tuple[Adapter, ...]] = {
    multihead_attention: (),
    gpt2_conv1d: (),
    gpt_bigcode: (gpt2_conv1d,),  # both read c_attn/c_proj; the flags multi_query/kv_heads are BigCode's only
    falcon: (interleaved_qkv,),  # Falcon's query_key_value is also recognised, wrongly, as [H, 3, d]
    interleaved_qkv: (),
    fused_blocks: (),
    deberta_v2: (separate_qkv,),
    deberta: (),
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
