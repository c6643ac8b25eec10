"""hf_geosharp: geodesic sharpness (da Silva, Dangel, Oore, ICML 2025) for Hugging Face models.

Importing the package writes nothing and starts nothing: the evaluate module is registered only by
``geosharp register`` (which ``scripts/install.sh`` runs), never as a side effect of ``import hf_geosharp``.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

from ._version import __version__
from .evaluate_module import register as _register

#: The public names and the modules that define them, imported on first use: ``import hf_geosharp`` (and so the
#: ``geosharp`` command's parser) does not import torch or transformers.
_PUBLIC = {
    "NotConvergedWarning": ".api", "SharpnessResult": ".api", "adaptive_sharpness": ".api",
    "geodesic_sharpness": ".api", "relative_flatness": ".engine.relative_flatness", "HideResult": ".hiding",
    "hide": ".hiding", "SymmetryMap": ".symmetry", "map_symmetries": ".symmetry", "reparametrize": ".symmetry",
    "measure_trainer": ".integrations", "GeodesicSharpnessCallback": ".integrations",
    "hessian_top_eigenvalue": ".engine.hessian", "hessian_trace": ".engine.hessian",
}

__all__ = ["HideResult", "NotConvergedWarning", "SharpnessResult", "SymmetryMap", "adaptive_sharpness",
           "geodesic_sharpness", "hessian_top_eigenvalue", "hessian_trace", "hide", "map_symmetries",
           "relative_flatness", "reparametrize",
           "EVALUATE_MODULE_DIR", "EVALUATE_MODULE_SCRIPT", "__version__"]

if TYPE_CHECKING:
    from .api import NotConvergedWarning, SharpnessResult, adaptive_sharpness, geodesic_sharpness
    from .engine.hessian import hessian_top_eigenvalue, hessian_trace
    from .engine.relative_flatness import relative_flatness
    from .hiding import HideResult, hide
    from .symmetry import SymmetryMap, map_symmetries, reparametrize


EVALUATE_MODULE_DIR = str(_register.MODULE_DIR)
"""The evaluate module's one folder as published (loading script and measurement card): ``metric_card/``."""
EVALUATE_MODULE_SCRIPT = str(_register.SCRIPT)
"""Its loading script, for a load by path from any directory: ``evaluate.load(EVALUATE_MODULE_SCRIPT)``."""


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept (see ``_PUBLIC``)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    if name != "hide":  # ``hide`` is also the deprecated sub-package name: _Package keeps the function in front of it
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported public ones included."""
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """The package's module type: ``gs.hide`` is the function, also after the deprecated name of the sub-package
    ``hf_geosharp.hiding``, ``hf_geosharp.hide``, was imported (the import system then sets the package's ``hide``
    attribute to it; that setter keeps it in ``sys.modules`` only)."""

    @property
    def hide(self) -> object:
        """:func:`hf_geosharp.hiding.transform.hide`."""
        from .hiding.transform import hide

        return hide

    @hide.setter
    def hide(self, _subpackage: object) -> None:
        pass


sys.modules[__name__].__class__ = _Package
