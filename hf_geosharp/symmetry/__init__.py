"""Where a model's continuous symmetries live: GL(h) pairs of attention heads and LoRA adapters.

``map_symmetries`` builds the :class:`SymmetryMap`, ``reparametrize`` applies a random group element (the probe
that every mapping must pass), ``smap.summary(model)`` is the symmetry report, and ``jacobian_rank_audit`` (whole tiny
models) and ``block_audit`` (attention blocks of any model) check the predicted dimensions.
"""

from .audit import jacobian_rank_audit
from .audit_blocks import block_audit
from .base import Fallback, PairBlock, SymmetryMap
from .group_action import reparametrize
from .mapping import map_symmetries
from .report import format_report, symmetry_report

__all__ = [
    "Fallback",
    "PairBlock",
    "SymmetryMap",
    "block_audit",
    "format_report",
    "jacobian_rank_audit",
    "map_symmetries",
    "reparametrize",
    "symmetry_report",
]
