"""``map_symmetries``: walk a live model and describe where its GL(h) pairs live (the :class:`SymmetryMap`).

Adapters in :mod:`hf_geosharp.symmetry.layouts` turn each attention module into q/k/v/o projections; this module
turns those into pairs in the orientation of docs/spec.md §4.3: per KV group a QK pair ``G`` = the group's query heads
``[W_q^{(i)T}; b_q^{(i)T}]`` stacked by rows, ``H = [W_k^{(g)T}; b_k^{(g)T}]``, and a VO pair ``G = [W_v^{(g)T};
b_v^{(g)T}]``, ``H`` = the group's ``W_O`` column slices stacked by rows. PEFT LoRA adapters add ``(B, A^T)`` pairs.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Literal

import torch
from torch import nn

from ..engine.geometry.lie import rope_commutant_basis
from .base import Fallback, PairBlock, SymmetryMap
from .layouts import ADAPTERS, AttentionLayout, LayoutContext, Proj, Unmappable, is_lora_layer
from .layouts.introspect import source

logger = logging.getLogger(__name__)

_ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)


def map_symmetries(
    model: nn.Module,
    strict: bool = False,
    params: Literal["all", "trainable"] = "all",
    include_bias: bool = True,
) -> SymmetryMap:
    """Map ``model`` onto its attention (and LoRA) symmetry group.

    Args:
        model: an instantiated model (``transformers`` or plain torch, possibly PEFT-wrapped).
        strict: raise a ``ValueError`` if any attention module could not be mapped, instead of listing it in
            ``smap.fallbacks`` and treating its parameters elementwise.
        params: ``"all"``, or ``"trainable"`` to map only pairs whose parameters all require grad (e.g. LoRA
            adapters on a frozen base).
        include_bias: append q/k/v biases to their pairs as an extra row (docs/spec.md §4.3). Without it, biased q/k/v
            are left out of the pairs and the group action is no longer an exact symmetry of the model.

    Returns:
        The :class:`SymmetryMap`; see ``smap.summary(model)`` for the report.
    """
    if params not in ("all", "trainable"):
        raise ValueError(f"params must be 'all' or 'trainable'; got {params!r}.")
    smap = SymmetryMap.empty(model)
    smap.scope = params
    if params == "trainable":
        smap.frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    builder = _PairBuilder(LayoutContext(model, smap.index_of), trainable_only=params == "trainable",
                           include_bias=include_bias)
    claimed: set[str] = set()
    for name, module in model.named_modules():
        if is_lora_layer(module):
            builder.add_lora(name, module, smap)
        if _inside(name, claimed):
            continue
        for adapter in ADAPTERS:
            try:
                layout = adapter(name, module, builder.ctx)
            except Unmappable as exc:
                smap.fallbacks.append(Fallback(name, f"{type(module).__name__}: {exc}"))
                claimed.add(name)
                break
            if layout is not None:
                builder.add_attention(layout)
                claimed.add(name)
                break
    smap.fallbacks += _unrecognised(model, claimed)
    smap.blocks = builder.blocks
    smap.notes = builder.notes()
    logger.debug(
        "symmetry map: %d QK, %d VO, %d LoRA pairs; %d fallback(s)",
        *(sum(b.n_pairs for b in smap.blocks if b.kind == kind) for kind in ("qk", "vo", "lora")),
        len(smap.fallbacks),
    )
    if strict and smap.fallbacks:
        listing = "\n".join(f"  - {f.module}: {f.reason}" for f in smap.fallbacks)
        raise ValueError(
            f"map_symmetries(strict=True): {len(smap.fallbacks)} attention module(s) could not be mapped onto "
            f"GL(h) pairs:\n{listing}\nPass strict=False to treat them elementwise (they are listed in "
            "smap.fallbacks and in the symmetry report), or add an adapter for this layout in "
            "hf_geosharp/symmetry/layouts/."
        )
    return smap


def _inside(name: str, claimed: set[str]) -> bool:
    """Whether a proper ancestor of module ``name`` is claimed (the root's name is ``""``)."""
    if not claimed or not name:
        return False
    parts = name.split(".")
    return any(".".join(parts[:i]) in claimed for i in range(len(parts)))


def _unrecognised(model: nn.Module, claimed: set[str]) -> list[Fallback]:
    """Attention-like modules with parameters that no adapter claimed (outermost only)."""
    out: list[Fallback] = []
    reported: set[str] = set()
    for name, module in model.named_modules():
        if not _ATTENTION_LIKE.search(type(module).__name__) or name in claimed:
            continue
        has_claimed_descendant = any(c.startswith(name + ".") for c in claimed) if name else bool(claimed)
        if has_claimed_descendant or _inside(name, claimed | reported):
            continue
        if next(module.parameters(), None) is None:
            continue
        out.append(Fallback(name, f"{type(module).__name__}: {structural_reason(module)}; its parameters are "
                                  "treated elementwise"))
        reported.add(name)
    return out


_SCORE_WORDS = ("softmax", "attention_interface", "scaled_dot_product_attention", "ALL_ATTENTION_FUNCTIONS",
                "eager_attention_forward")
# child names that identify an attention variant no adapter maps, with what in it breaks (or escapes) the pair form
_KNOWN_VARIANTS = (
    ("sampling_offsets", "multiscale deformable attention: the attention weights are a linear map of the query "
                         "alone and the values are sampled at predicted offsets, so there is no q.k score and no QK "
                         "pair (a per-head VO pair would survive, which no adapter maps yet)"),
    ("longformer_self_attn", "Longformer attention: separate global query/key/value projections score the global "
                             "tokens, a second QK pair on the same heads that no adapter stacks yet"),
    ("experts", "mixture of attention heads: the query and output projections are experts routed per token, so a "
                "head's W_q and W_O change from token to token"),
    ("r_w_bias", "Transformer-XL relative attention with learned content and position biases added to q"),
    ("r_r_bias", "relative attention with position biases added to q (Funnel)"),
    ("o_a_proj", "grouped low-rank output projection (o_a/o_b) and a compressed KV cache with its own projections"),
)


def structural_reason(module: nn.Module) -> str:
    """Why no adapter maps ``module``: the operation that breaks the GL(h) pairs, or the parameters that no known
    layout accounts for, read off its children, parameters and forward source."""
    children = {n.split(".")[-1] for n, _ in module.named_modules()} | {n.split(".")[-1] for n, _ in
                                                                        module.named_parameters()}
    for child, why in _KNOWN_VARIANTS:
        if child in children:
            return why
    linear = [n for n, sub in module.named_modules() if isinstance(getattr(sub, "weight", None), torch.Tensor)
              and sub.weight.dim() == 2]
    convs = [n for n, sub in module.named_modules() if isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    params = [n for n, _ in module.named_parameters()]
    if not linear and convs:
        return (f"the projections are convolutions ({', '.join(convs[:6])}): the adapters read q/k/v/o as linear "
                "maps of the token features, so a convolution's spatial taps are not a layout they can pair")
    if not linear:
        shown = ", ".join(params[:6]) + (", ..." if len(params) > 6 else "")
        return f"no projection matrices (parameters: {shown}): no q/k/v/o layout to pair"
    sources = [source(type(sub).forward) for sub in module.modules()]
    if not any(word in src for src in sources for word in _SCORE_WORDS):
        return ("no softmax over q.k scores in the forward (linear, additive, gated or recurrent attention): the "
                f"GL(h) argument needs scores that see q and k only through q k^T (matrices: {', '.join(linear[:6])})")
    shown = ", ".join(linear[:8]) + (", ..." if len(linear) > 8 else "")
    return (f"the matrices {shown} are not a known q/k/v/o layout: no adapter can tell which output units are which "
            "head's query, key and value, so the layout cannot account for these parameters")


class _PairBuilder:
    """Turns layouts and LoRA layers into :class:`PairBlock` s and collects notes for the report."""

    def __init__(self, ctx: LayoutContext, trainable_only: bool, include_bias: bool) -> None:
        self.ctx = ctx
        self.trainable_only = trainable_only
        self.include_bias = include_bias
        self.blocks: list[PairBlock] = []
        self._notes: dict[str, list[str]] = defaultdict(list)
        self._owner: dict[int, str] = {}  # id(parameter) -> module that mapped it (tied weights are mapped once)

    def notes(self) -> list[str]:
        out = []
        for text, modules in self._notes.items():
            shown = ", ".join(modules[:4]) + (f", ... ({len(modules)} modules)" if len(modules) > 4 else "")
            out.append(f"{text} [{shown}]")
        return out

    def _note(self, text: str, module: str) -> None:
        self._notes[text].append(module)

    def _add(self, block: PairBlock, params: list[nn.Parameter]) -> None:
        if self.trainable_only and not all(p.requires_grad for p in params):
            self._note("pairs touching frozen parameters are not mapped (params='trainable')", block.module)
            return
        owners = {self._owner[id(p)] for p in params if id(p) in self._owner} - {block.module}
        if owners:
            self._note(f"{block.kind.upper()} pair shares (tied) parameters with {sorted(owners)}; mapped once",
                       block.module)
            return
        for p in params:
            self._owner[id(p)] = block.module
        self.blocks.append(block)

    def _rows(self, proj: Proj, unit: int, d: int, extra: Proj | None) -> torch.Tensor:
        """``[n(+1)(+1), d]``: the transposed weight rows of head ``unit``, with bias and extra-token rows."""
        cols = [proj.weight[unit * d:(unit + 1) * d]]
        if self.include_bias and proj.bias is not None:
            cols.append(proj.bias[unit * d:(unit + 1) * d, None])
        if self.include_bias and extra is not None:
            cols.append(extra.weight[unit * d:(unit + 1) * d, None])
        return torch.cat(cols, dim=1).T

    def _params(self, *projs: Proj | None) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        for proj in projs:
            if proj is not None:
                out += proj.params if self.include_bias else proj.params[:1]
        return out

    @staticmethod
    def _rope_basis(lay: AttentionLayout) -> torch.Tensor:
        rotary_dim, interleaved = lay.rope
        return rope_commutant_basis(lay.head_dim, rotary_dim, interleaved=interleaved)

    def add_attention(self, lay: AttentionLayout) -> None:
        d, per_group = lay.head_dim, lay.n_heads // lay.n_kv
        groups = [range(g * per_group, (g + 1) * per_group) for g in range(lay.n_kv)]
        labels = [f"{lay.module} head {g}" if per_group == 1 else
                  f"{lay.module} kv-group {g} (heads {grp[0]}-{grp[-1]})" for g, grp in enumerate(groups)]
        has_bias = any(p.bias is not None for p in (lay.q, lay.k, lay.v)) or lay.k_extra is not None
        if has_bias and not self.include_bias:
            self._note("q/k/v biases left out of the pairs (include_bias=False): the group action then changes the "
                       "model's function", lay.module)
        if lay.qk_norm is not None:
            self._note(lay.qk_norm, lay.module)
        elif lay.q.lora or lay.k.lora:
            self._note("LoRA on q/k: the QK pair is left unmapped because a LoRA factor cannot belong to two groups; "
                       "the adapters' (B, A) pairs are mapped instead", lay.module)
        else:
            g_index = torch.stack([torch.cat([self._rows(p, i, d, None) for i in grp for p in (lay.q, *lay.q_more)])
                                   for grp in groups])
            h_index = torch.stack([torch.cat([self._rows(lay.k, g, d, lay.k_extra)]
                                             + [self._rows(p, g, d, None) for p in lay.k_more])
                                   for g in range(lay.n_kv)])
            basis, note = None, f"{lay.layout}; GL({d})"
            if lay.rope is not None:
                rotary_dim, interleaved = lay.rope
                basis = self._rope_basis(lay)
                pairing = "(2j, 2j+1)" if interleaved else "(j, j+r/2)"
                note = (f"{lay.layout}; RoPE on {rotary_dim} of {d} dims, pairs {pairing}: GL({d}) reduced to the "
                        f"commutant of the rotations (dim {basis.shape[0]})")
            if lay.q_more or lay.k_more:
                note += "; relative-position projections stacked onto G (queries) and H (keys)"
            if lay.key_bias_visible:
                note += f"; key bias visible ({lay.key_bias_visible})"
            elif self.include_bias and lay.k.bias is not None and lay.rope is None:  # RoPE rotates b_k per key
                self._note("key bias is invisible to softmax (q.b_k is the same for every key): its coordinates are "
                           "redundant beyond the GL orbit", lay.module)
            self._add(PairBlock("qk", lay.module, g_index, h_index, basis, labels, note),
                      self._params(lay.q, *lay.q_more, lay.k, lay.k_extra, *lay.k_more))
        if lay.rope_part is not None:
            self._add_rope_part(lay)
        if lay.v.lora or lay.o.lora:
            self._note("LoRA on v/o: the VO pair is left unmapped because a LoRA factor cannot belong to two groups; "
                       "the adapters' (B, A) pairs are mapped instead", lay.module)
            return
        d = lay.vo_head_dim
        g_index = torch.stack([self._rows(lay.v, g, d, lay.v_extra) for g in range(lay.n_kv)])
        h_index = torch.stack([torch.cat([lay.o.weight[:, i * d:(i + 1) * d] for i in grp]) for grp in groups])
        basis, note = None, f"{lay.layout}; GL({d})"
        if lay.rope_on_values:
            basis = self._rope_basis(lay)
            note = f"{lay.layout}; values are rotated too: GL({d}) reduced to the commutant of the rotations"
        self._add(PairBlock("vo", lay.module, g_index, h_index, basis, labels, note),
                  self._params(lay.v, lay.v_extra) + [lay.o.params[0]])

    def _add_rope_part(self, lay: AttentionLayout) -> None:
        """One QK pair over all heads for MLA's decoupled RoPE slices: ``G`` stacks every head's rotated query rows,
        ``H`` is the rotated key that all heads share, so one element of the RoPE commutant acts on all of them."""
        part = lay.rope_part
        r = part.k.out_features
        if part.q.lora or part.k.lora:
            return
        g_index = torch.cat([self._rows(part.q, i, r, None) for i in range(lay.n_heads)])[None]
        h_index = self._rows(part.k, 0, r, None)[None]
        basis, note = None, f"{lay.layout}; decoupled RoPE part (key shared by all heads): GL({r})"
        if part.rope is not None:
            rotary_dim, interleaved = part.rope
            basis = rope_commutant_basis(r, rotary_dim, interleaved=interleaved)
            pairing = "(2j, 2j+1)" if interleaved else "(j, j+r/2)"
            note = (f"{lay.layout}; decoupled RoPE part (key shared by all heads), pairs {pairing}: GL({r}) reduced "
                    f"to the commutant of the rotations (dim {basis.shape[0]})")
        self._add(PairBlock("qk", lay.module, g_index, h_index, basis, [f"{lay.module} RoPE part (all heads)"], note),
                  self._params(part.q, part.k))

    def add_lora(self, name: str, module: nn.Module, smap: SymmetryMap) -> None:
        """One GL(r) pair ``(G, H) = (B, A^T)`` per adapter: the update ``B A`` is all the model sees."""
        for a_attr, b_attr in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
            a_dict, b_dict = getattr(module, a_attr, None), getattr(module, b_attr, None)
            for key in (a_dict or {}):
                a = a_dict[key] if isinstance(a_dict, nn.ParameterDict) else a_dict[key].weight
                b = b_dict[key] if isinstance(b_dict, nn.ParameterDict) else b_dict[key].weight
                rank = a.shape[0]
                if b.dim() < 2 or b.shape[1] != rank or any(s != 1 for s in b.shape[2:]):
                    smap.fallbacks.append(Fallback(f"{name}.{a_attr}.{key}", f"LoRA factors of shapes "
                                                   f"{tuple(b.shape)} and {tuple(a.shape)} are not a rank-{rank} "
                                                   "product B A; treated elementwise"))
                    continue
                g_index = self.ctx.index(b).reshape(b.shape[0], rank)
                h_index = self.ctx.index(a).reshape(rank, -1).T
                block = PairBlock("lora", name, g_index[None], h_index[None], None, [f"{name} adapter {key!r}"],
                                  f"LoRA update B A: GL({rank}) on the adapter rank")
                self._add(block, [b, a])
