"""Where a model's continuous symmetries live: GL(h) pairs of attention heads and LoRA adapters.

``map_symmetries`` builds the :class:`SymmetryMap`, ``reparametrize`` applies a random group element (the probe
that every mapping must pass), ``smap.summary(model)`` is the symmetry report and ``jacobian_rank_audit`` checks
the predicted dimensions on tiny models.
"""

from .audit import jacobian_rank_audit
from .base import Fallback, PairBlock, SymmetryMap
from .mapping import map_symmetries
from .report import format_report, symmetry_report
from .reparametrize import reparametrize

__all__ = [
    "Fallback",
    "PairBlock",
    "SymmetryMap",
    "format_report",
    "jacobian_rank_audit",
    "map_symmetries",
    "reparametrize",
    "symmetry_report",
]
