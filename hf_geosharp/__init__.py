"""hf_geosharp: geodesic sharpness (da Silva, Dangel, Oore, ICML 2025) for Hugging Face models.

Importing the package writes nothing and starts nothing: the evaluate module is registered only by
``geosharp register`` (which ``scripts/install.sh`` runs), never as a side effect of ``import hf_geosharp``.
"""

from ._version import __version__
from .api import NotConvergedWarning, SharpnessResult, adaptive_sharpness, geodesic_sharpness
from .engine.hessian import hessian_top_eigenvalue, hessian_trace
from .engine.relative_flatness import relative_flatness
from .hide import HideResult, hide
from .symmetry import SymmetryMap, map_symmetries, reparametrize

__all__ = ["HideResult", "NotConvergedWarning", "SharpnessResult", "SymmetryMap", "adaptive_sharpness",
           "geodesic_sharpness", "hessian_top_eigenvalue", "hessian_trace", "hide", "map_symmetries",
           "relative_flatness", "reparametrize",
           "EVALUATE_MODULE_DIR", "EVALUATE_MODULE_SCRIPT", "__version__"]

from .evaluate_module import register as _register

EVALUATE_MODULE_DIR = str(_register.MODULE_DIR)
"""The evaluate module's one folder as published (loading script and measurement card): ``metric_card/``."""
EVALUATE_MODULE_SCRIPT = str(_register.SCRIPT)
"""Its loading script, for a load by path from any directory: ``evaluate.load(EVALUATE_MODULE_SCRIPT)``."""

_register.quiet_cache_notice()  # evaluate's "using the latest cached version" notice, for this module only


def __getattr__(name: str) -> object:
    """``gs.measure_trainer`` and ``gs.GeodesicSharpnessCallback``, imported with transformers only when used."""
    if name in ("measure_trainer", "GeodesicSharpnessCallback"):
        from . import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
