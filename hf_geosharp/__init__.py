"""hf_geosharp: geodesic sharpness (da Silva, Dangel, Oore, ICML 2025) for Hugging Face models.

Importing the package writes nothing and starts nothing: the evaluate module is registered only by
``geosharp register`` (which ``scripts/install.sh`` runs), never as a side effect of ``import hf_geosharp``.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
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

_register.quiet_cache_notice()  # evaluate's "using the latest cached version" notice, for this module only


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


class _Alias(importlib.abc.Loader):
    """Loads a deprecated module name as the module it was renamed to (the same module object)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _RenamedModules(importlib.abc.MetaPathFinder):
    """``hf_geosharp.hide[.seek|.transform]``, the old name of ``hf_geosharp.hiding`` (renamed so that no module is
    shadowed by the function ``gs.hide``), still imports, with a ``DeprecationWarning``."""

    OLD, NEW = f"{__name__}.hide", f"{__name__}.hiding"

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.OLD and not fullname.startswith(self.OLD + "."):
            return None
        new = self.NEW + fullname[len(self.OLD):]
        warnings.warn(f"{fullname} is deprecated and will be removed: import {new}.", DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


if not any(isinstance(finder, _RenamedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RenamedModules())  # before any finder that knows the old path (an older install)
sys.modules[__name__].__class__ = _Package
