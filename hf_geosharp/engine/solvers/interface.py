"""What the solvers ask of a perturbation space and of an objective."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal, Protocol

import torch
from torch import Tensor

#: What the solvers call: ``objective(xi, need_grad, out=None) -> (loss, gradient or None)`` (the engine's is
#: :class:`hf_geosharp.engine.model_function.objective.Objective`).
ObjectiveFn = Callable[..., tuple[float, "Tensor | None"]]
#: The objective with its gradient left pending: ``pending(xi, out)`` enters a block that yields the loss and a
#: function taking the gradient into ``out`` (:meth:`hf_geosharp.engine.model_function.objective.Objective.pending`).
PendingFn = Callable[[Tensor, Tensor], AbstractContextManager[tuple[Tensor, Callable[[], None]]]]
StepNormalization = Literal["riemannian", "euclidean", "none"]


class Space(Protocol):
    """What the solvers ask of a perturbation space (``held_bytes`` and ``total`` only for the memory rule, when the
    objective names a model; ``ascent_direction``'s ``save`` only when the best point's gradient is kept)."""

    held_bytes: int

    def zero(self) -> Tensor:
        """A zero tangent vector (the clean point)."""

    def empty(self) -> Tensor:
        """An uninitialised vector of the space's length and dtype (a solver buffer)."""

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor,
                         save: Tensor | None = None) -> tuple[Tensor, float, list[float]]:
        """The step direction from a Euclidean gradient, into ``out``, with its squared norm and its products with
        ``vectors``' rows (and a copy of ``egrad`` in ``save``)."""

    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A random feasible direction (further starts of ``steps="auto"``)."""

    def norm(self, xi: Tensor) -> Tensor:
        """The metric norm of a tangent vector."""

    def total(self, values: Tensor) -> Tensor:
        """``values`` summed over the ranks of a sharded run."""

