"""Integrations with the tools people train with: the ``transformers`` Trainer.

:class:`GeodesicSharpnessCallback` measures sharpness during training and logs it next to the loss;
:func:`measure_trainer` measures a trainer's model once, after ``trainer.train()``. They import ``transformers`` only
when first used, so that ``import hf_geosharp`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GeodesicSharpnessCallback", "measure_trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
