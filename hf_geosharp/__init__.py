"""hf_geosharp: geodesic sharpness (da Silva, Dangel, Oore, ICML 2025) for Hugging Face models."""

__version__ = "0.1.0"

from .api import SharpnessResult, adaptive_sharpness, geodesic_sharpness  # noqa: E402
from .hide import HideResult, hide  # noqa: E402
from .symmetry import SymmetryMap, map_symmetries, reparametrize  # noqa: E402

import os as _os  # noqa: E402

EVALUATE_MODULE_DIR = _os.path.join(_os.path.dirname(__file__), "geodesic_sharpness")
"""Folder of the evaluate loading script: ``evaluate.load(hf_geosharp.EVALUATE_MODULE_DIR)`` works from any cwd."""

if _os.environ.get("HF_GEOSHARP_NO_AUTOREGISTER", "0") != "1":
    from .register import autoregister as _autoregister  # noqa: E402

    _autoregister()  # so that a later bare evaluate.load("geodesic_sharpness") resolves from any cwd
