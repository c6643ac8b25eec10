"""The engine: the mathematics of geodesic sharpness and its execution, from a symmetry map and a model to a result.

One job per module or sub-package (docs/architecture.md): ``geometry/``, ``space/``, ``solvers/``, ``model_function/``,
``placement/``, the one ``builder`` and the ``runner``. Nothing here imports a face; the public functions are
:mod:`hf_geosharp.api`.
"""
