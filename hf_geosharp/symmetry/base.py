"""Data structures that describe where a model's continuous symmetries live.

A :class:`SymmetryMap` is the contract between the symmetry mapper (which knows ``transformers`` modules) and the
perturbation space (which knows geometry only). Every parameter of the model is a slice of one *flat parameter
vector*: ``torch.cat([p.reshape(-1) for _, p in named_parameters])`` in ``model.named_parameters()`` order (tied
weights appear once). A GL(h) pair is then just two integer index tensors into that vector, built by slicing
``offset + arange(numel).view(shape)`` exactly as one would slice the real weight. This covers separate, fused,
interleaved and grouped layouts, appended bias rows and stacked GQA heads with one representation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

from .report import symmetry_report

PairKind = Literal["qk", "vo", "lora", "linear"]


@dataclass
class PairBlock:
    """``k`` GL(h) pairs of equal shape, stacked over heads.

    The function depends on ``(G, H)`` only through ``G @ H.T`` for each of the ``k`` pairs, with
    ``G = theta[G_index]`` of shape ``[k, n, h]`` and ``H = theta[H_index]`` of shape ``[k, m, h]``.

    Attributes:
        kind: what the pair is (``"qk"``, ``"vo"``, ``"lora"``, ``"linear"``).
        module: dotted path of the module that owns the pairs (for reports).
        G_index: ``[k, n, h]`` int64 flat indices into the parameter vector.
        H_index: ``[k, m, h]`` int64 flat indices into the parameter vector.
        lie_basis: ``None`` for the full group GL(h); otherwise a ``[b, h, h]`` basis of the Lie algebra of the
            subgroup that really acts (e.g. the commutant of RoPE rotations), shared by all ``k`` pairs.
        labels: one human-readable label per pair, e.g. ``"layer 0 head 3"``.
        note: why the group is what it is (shown in the symmetry report).
    """

    kind: PairKind
    module: str
    G_index: torch.Tensor
    H_index: torch.Tensor
    lie_basis: torch.Tensor | None = None
    labels: list[str] = field(default_factory=list)
    note: str = ""

    def __post_init__(self) -> None:
        if self.G_index.dim() != 3 or self.H_index.dim() != 3:
            raise ValueError(
                f"PairBlock {self.module!r}: G_index and H_index must be [k, n, h] and [k, m, h]; "
                f"got {tuple(self.G_index.shape)} and {tuple(self.H_index.shape)}."
            )
        if self.G_index.shape[0] != self.H_index.shape[0] or self.G_index.shape[2] != self.H_index.shape[2]:
            raise ValueError(
                f"PairBlock {self.module!r}: G_index {tuple(self.G_index.shape)} and H_index "
                f"{tuple(self.H_index.shape)} must agree on k (dim 0) and h (dim 2)."
            )
        h = self.G_index.shape[2]
        if self.lie_basis is not None and (self.lie_basis.dim() != 3 or self.lie_basis.shape[1:] != (h, h)):
            raise ValueError(f"PairBlock {self.module!r}: lie_basis must be [b, {h}, {h}].")

    @property
    def n_pairs(self) -> int:
        """The number of stacked head pairs ``k``."""
        return self.G_index.shape[0]

    @property
    def head_dim(self) -> int:
        """The head size ``h`` (the ``h`` of GL(h))."""
        return self.G_index.shape[2]

    @property
    def group_dim(self) -> int:
        """Dimension of the group acting on one pair (h^2 for GL(h))."""
        return self.head_dim**2 if self.lie_basis is None else self.lie_basis.shape[0]


@dataclass
class Fallback:
    """A module whose symmetry was not mapped; its parameters are treated elementwise."""

    module: str
    reason: str


@dataclass
class SymmetryMap:
    """Where the GL(h) pairs of a model live, as index maps into its flat parameter vector.

    Attributes:
        param_names: names of the parameters, in flat-vector order (``model.named_parameters()``, deduplicated).
        param_shapes: their shapes.
        blocks: the pair blocks; their index sets are disjoint.
        fallbacks: modules with attention-like parameters that could not be mapped (treated elementwise).
        notes: other remarks for the report (e.g. "key bias is invisible to softmax").
        scope: ``"all"``, or ``"trainable"`` when only pairs of trainable parameters were mapped
            (``map_symmetries(params="trainable")``); the flat vector still covers all parameters.
        frozen: names of the parameters that ``scope="trainable"`` leaves out (no ``requires_grad`` when mapped).
    """

    param_names: list[str]
    param_shapes: list[torch.Size]
    blocks: list[PairBlock] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scope: Literal["all", "trainable"] = "all"
    frozen: list[str] = field(default_factory=list)

    @property
    def offsets(self) -> list[int]:
        """Each parameter's start in the flat concatenation of all parameters, in map order."""
        out, total = [], 0
        for shape in self.param_shapes:
            out.append(total)
            total += int(torch.Size(shape).numel())
        return out

    @property
    def n_params(self) -> int:
        """The length of the flat concatenation of all parameters."""
        return sum(int(torch.Size(s).numel()) for s in self.param_shapes)

    @classmethod
    def empty(cls, model: torch.nn.Module) -> SymmetryMap:
        """A map with no pairs: every parameter is elementwise (adaptive sharpness)."""
        named = list(model.named_parameters())
        return cls([n for n, _ in named], [p.shape for _, p in named])

    def index_of(self, name: str) -> torch.Tensor:
        """``offset + arange(numel).view(shape)`` for parameter ``name``: slice it like the weight itself.

        Args:
            name: a name of ``model.named_parameters()``.

        Returns:
            The parameter's indices into the flat parameter vector, shaped like the parameter.
        """
        i = self.param_names.index(name)
        shape = torch.Size(self.param_shapes[i])
        return self.offsets[i] + torch.arange(shape.numel()).view(shape)

    def summary(self, model: torch.nn.Module | None = None) -> dict:
        """The symmetry report as a JSON-ready dict; pass ``model`` to add per-head conditioning of G and H.

        Args:
            model: the mapped model, for the per-head conditioning (optional).

        Returns:
            The report of :func:`hf_geosharp.symmetry.report.symmetry_report` (pairs, coverage, warnings).
        """
        return symmetry_report(self, model)


def renamed_map(symmetry_map: SymmetryMap | None, smap: SymmetryMap | None, where: str) -> SymmetryMap | None:
    """The map a function was given: ``symmetry_map=``, or the deprecated ``smap=`` (with a ``DeprecationWarning``
    pointing at the caller), the keyword every public function now spells as ``gs.geodesic_sharpness`` does.

    Args:
        symmetry_map: the map passed as ``symmetry_map=``.
        smap: the map passed under the old name.
        where: the public function's name, for the messages.

    Returns:
        The map given (``None``: the function maps the model itself).
    """
    if smap is None:
        return symmetry_map
    if symmetry_map is not None:
        raise TypeError(f"{where}: pass symmetry_map= only (smap= is its old name).")
    warnings.warn(f"{where}(smap=...) is deprecated and will be removed: pass symmetry_map=... (as "
                  "gs.geodesic_sharpness takes it).", DeprecationWarning, stacklevel=3)
    return smap
