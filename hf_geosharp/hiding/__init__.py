"""``hide``: move a model along its symmetry group to make a non-invariant sharpness measure look flat or sharp.

:mod:`.transform` holds the transformation (:func:`hide`, and :func:`reparametrize_checked` for a random element,
both with the function check); :mod:`.seek` the hide & seek experiment on a population of models and its report. The
search itself is the engine's (:mod:`hf_geosharp.engine.symmetry_search`).
"""

from .seek import SeekReport, hide_and_seek, seek_figure, seek_lines
from .transform import (
    DEFAULT_CONDITION,
    TARGETABLE,
    FunctionChangedError,
    HideResult,
    LossFn,
    Target,
    hide,
    reparametrize_checked,
)

__all__ = ["DEFAULT_CONDITION", "TARGETABLE", "FunctionChangedError", "HideResult", "LossFn", "SeekReport", "Target",
           "hide", "hide_and_seek", "reparametrize_checked", "seek_figure", "seek_lines"]
