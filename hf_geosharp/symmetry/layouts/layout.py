"""The description an adapter returns: projections as flat index tensors (:class:`Proj`), one attention module as
q/k/v/o (:class:`AttentionLayout`), what adapters may read (:class:`LayoutContext`), and PEFT LoRA detection."""

from __future__ import annotations

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
        """Rows of the projection (``nn.Linear`` orientation)."""
        return self.weight.shape[0]

    def select(self, rows: torch.Tensor | slice) -> Proj:
        """The sub-projection made of the given output units (fused layouts)."""
        bias = None if self.bias is None else self.bias[rows]
        return Proj(self.weight[rows], bias, self.params, self.lora)


@dataclass
class DecoupledRope:
    """The decoupled RoPE part of multi-head latent attention: every head's rotated query slice (``q``, head-major
    ``[H*r]`` units) meets one rotated key of ``r`` units shared by all heads (``k``, MQA-style). ``rope`` is
    ``(r, interleaved)``, or ``None`` where the forward does not rotate it (then GL(r) acts)."""

    q: Proj
    k: Proj
    rope: tuple[int, bool] | None


@dataclass
class AttentionLayout:
    """One attention module as projections: head ``i`` owns q rows and o columns ``[i*d, (i+1)*d)``.

    KV head ``g`` owns k and v rows ``[g*d, (g+1)*d)`` and serves query heads ``g*H/KV ... (g+1)*H/KV - 1``
    (``repeat_kv`` order). ``rope`` is ``(rotary_dim, interleaved)``; ``rope_on_values`` says that values are
    rotated too (RoFormer ``rotary_value``). ``k_extra``/``v_extra`` are learned extra key/value tokens
    (``add_bias_kv``); their ``weight`` is a vector ``[KV*d]``. ``q_more``/``k_more`` are further projections whose
    head slices meet the keys/queries in a score term (DeBERTa's relative-position projections): their rows are
    stacked onto the QK pair's ``G``/``H``. ``key_bias_visible`` says why the key bias is seen (``None``: it is not).
    Multi-head latent attention adds three things: ``v_head_dim``, the VO head size where it differs from the QK
    ``head_dim``; ``rope_part``, a second QK pair (one group over all heads) for the decoupled RoPE slices; and
    ``latent``, parameters the layout explains but leaves out of every pair (the latent down-projections and their
    RMSNorms), which are treated elementwise.
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
    v_head_dim: int | None = None
    rope_part: DecoupledRope | None = None
    latent: tuple[nn.Parameter, ...] = ()

    @property
    def vo_head_dim(self) -> int:
        """The value/output head size (the query/key head size unless the layout says otherwise)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def validate(self) -> None:
        """Raise :class:`Unmappable` for head counts and sizes no attention can have."""
        h, kv, d, dv = self.n_heads, self.n_kv, self.head_dim, self.vo_head_dim
        if d <= 0 or dv <= 0 or h <= 0 or kv <= 0 or h % kv:
            raise Unmappable(f"inconsistent head counts: {h} query heads, {kv} KV heads, head_dim {d}")
        expected = {"q": (self.q.out_features, h * d), "k": (self.k.out_features, kv * d),
                    "v": (self.v.out_features, kv * dv), "o input": (self.o.weight.shape[1], h * dv)}
        if self.rope_part is not None:
            r = self.rope_part.k.out_features
            expected |= {"rotated q": (self.rope_part.q.out_features, h * r)}
        expected |= {f"extra q {i}": (p.out_features, h * d) for i, p in enumerate(self.q_more)}
        expected |= {f"extra k {i}": (p.out_features, kv * d) for i, p in enumerate(self.k_more)}
        for what, (got, want) in expected.items():
            if got != want:
                dims = f"head_dim {d}" + (f", v_head_dim {dv}" if dv != d else "")
                raise Unmappable(f"{what} has {got} units but {h} heads x {kv} KV heads x {dims} need {want}")


class LayoutContext:
    """What adapters need besides the module: flat indices of parameters and the model's config."""

    def __init__(self, model: nn.Module, index_of: Callable[[str], torch.Tensor]) -> None:
        self.config = getattr(model, "config", None)
        self._index_of = index_of
        self._names = {}
        for name, p in model.named_parameters():
            self._names.setdefault(id(p), name)

    def index(self, param: nn.Parameter) -> torch.Tensor:
        """The flat indices of ``param``'s entries in the model's parameter vector."""
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


Adapter = Callable[[str, nn.Module, LayoutContext], "AttentionLayout | None"]
"""An adapter: ``(module name, module, context) -> AttentionLayout``, ``None`` (not its layout), or raises
:class:`Unmappable`."""
