"""evaluate loading script for ``geodesic_sharpness``: a thin shim over the installed ``hf_geosharp`` package.

Symmetry-invariant (geodesic) sharpness of a transformers model, with adaptive sharpness as a baseline
(da Silva, Dangel, Oore, ICML 2025). The measurement itself lives in :mod:`hf_geosharp.evaluate_module.measurement`;
evaluate loads the first measurement class it finds in this namespace, so nothing else may be imported here.
"""

from hf_geosharp.evaluate_module.measurement import GeodesicSharpness

__all__ = ["GeodesicSharpness"]
