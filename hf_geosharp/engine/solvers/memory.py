"""The solve's memory policy: whether Auto-PGD keeps its best point's gradient (a fifth parameter-sized vector) or
recomputes it at a restart, decided by the caller from what it knows of the model, the space and the clean point's
activations (:func:`gradient_rule`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .interface import Space

logger = logging.getLogger(__name__)

#: Memory goal of a solve, everywhere: what it holds beyond a plain forward+backward of the model, in bytes per
#: parameter of the model.
BYTES_PER_PARAMETER_GOAL = 16
#: Memory goal of a solve where the model's activations leave room for it: its peak, relative to a plain
#: forward+backward's.
PEAK_RATIO_GOAL = 1.5
#: The share of the bytes goal the rule leaves for what a solve holds besides its vectors and the space (the
#: allocator's rounding, a pass's temporaries): the memory suite measured 16.04 bytes per parameter where five
#: vectors and the space came to 15.94 (BERT-base, clean adaptive).
BYTES_MARGIN = 0.02
#: Where the device reports its free memory (CUDA), the geometry's scratch may grow beyond what the bytes goal leaves,
#: into this share of the memory that is free once the solve's vectors are counted (the rest is left to the model's
#: activations and the allocator): one head chunk per pair group keeps a step's kernels independent of depth, and a
#: deep model (24 x 1024) needs about 19 bytes per perturbed parameter for it where the goal gives 16.
FREE_MEMORY_SHARE = 0.5
#: The parameter-sized vectors a solve may still allocate after its workspace is sized (four rows and the kept
#: gradient).
SOLVER_VECTORS = 5


@dataclass(frozen=True)
class Footprint:
    """What a solve holds, in bytes, as known before its first step (summed over the ranks of a sharded run): the
    inputs of :func:`keeps_best_gradient`.

    Attributes:
        vector: one solver vector.
        space: what the space holds besides the vectors (the pairs' ``h x h`` caches, index maps, its workspace).
        parameters: the model's parameter count.
        weights: the model's parameters.
        activations: what the clean point's forward saved for its backward, weights excluded.
    """

    vector: int
    space: int
    parameters: int
    weights: int
    activations: int


def keeps_best_gradient(footprint: Footprint) -> bool:
    """Whether :func:`apgd` keeps its best point's gradient (a fifth vector) instead of recomputing it with one more
    forward and backward at each restart from that point. The stored gradient is the one a recomputation would give,
    bit for bit, so the choice changes time and memory, never the number.

    The rule: keep it when the solve, with it, stays within the memory goals it meets without it.

    * :data:`BYTES_PER_PARAMETER_GOAL` holds everywhere: the five vectors and the space's own memory must fit in it,
      with :data:`BYTES_MARGIN` to spare.
    * :data:`PEAK_RATIO_GOAL` is met only where the activations are large enough. A plain forward+backward's peak is
      estimated between ``weights + activations`` (its least) and ``2 weights + activations`` (its most, every
      gradient written); the fifth vector is kept if the solve's extra memory with it is within the goal's headroom
      of the least, or if it already exceeds the headroom of the most without it (the goal is then out of reach
      whatever the solver stores, and the bytes goal bounds the cost). In between it is not kept: near the goal,
      the estimate cannot tell on which side the solve falls.

    Small batches (a MiniLM at 1024 tokens) keep it, large ones (64 x 128 tokens) too, and a MiniLM at 16 x 128
    tokens, whose four vectors fit the peak goal and five would not, recomputes."""
    return _within_goals(footprint, kept=1)


def keeps_clean_gradient(footprint: Footprint) -> bool:
    """Whether :func:`apgd` keeps the gradient at its clean point (``xi = 0``: the loss's gradient at the trained
    weights) for the breakdown of its best point (:meth:`~hf_geosharp.engine.worst_direction.WorstDirection.read`),
    instead of one more forward and backward after the solve. The same bits either way.

    The rule of :func:`keeps_best_gradient`, with both gradients kept (six vectors): a sixth vector during the solve
    is what the breakdown's own forward and backward would otherwise cost after it."""
    return _within_goals(footprint, kept=2)


def _within_goals(footprint: Footprint, kept: int) -> bool:
    """Whether ``kept`` more vectors beside the solver's four keep the solve within the memory goals it meets without
    them (:func:`keeps_best_gradient`)."""
    four = 4 * footprint.vector + footprint.space
    more = four + kept * footprint.vector
    if more > (1.0 - BYTES_MARGIN) * BYTES_PER_PARAMETER_GOAL * footprint.parameters:
        return False
    headroom = PEAK_RATIO_GOAL - 1.0
    least = footprint.weights + footprint.activations
    most = 2 * footprint.weights + footprint.activations
    return more <= headroom * least or four > headroom * most


def workspace_room(parameters: int, vector_bytes: int, free: int | None = None) -> int:
    """The bytes the geometry's scratch workspace may grow to (:meth:`~..space.workspace.Workspace.plan` takes only
    what one head chunk per pair group needs, within this).

    Everywhere: what :data:`BYTES_PER_PARAMETER_GOAL` leaves beside four solver vectors, its margin kept. Where the
    device reports ``free`` memory (a GPU), also up to :data:`FREE_MEMORY_SHARE` of what is free once the solver's
    vectors are counted, if that is more: a GPU with room then runs every pair group in one chunk, and the goal binds
    only where the memory does (a CPU's memory is shared with everything else on the machine, and is not probed).

    Args:
        parameters: the model's parameter count.
        vector_bytes: the bytes of one solver vector.
        free: the device's free memory in bytes (:func:`device_free_bytes`), or None where it is not known.

    Returns:
        The workspace's limit in bytes (never negative)."""
    room = int((1.0 - BYTES_MARGIN) * BYTES_PER_PARAMETER_GOAL * parameters) - 4 * vector_bytes
    if free is not None:
        room = max(room, int(FREE_MEMORY_SHARE * (free - SOLVER_VECTORS * vector_bytes)))
    return max(room, 0)


def device_free_bytes(device: torch.device) -> int | None:
    """The memory a CUDA ``device`` can still give (free on the device plus what PyTorch's allocator holds unused);
    None on any other device."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[list[int]]:
    """Count the bytes the autograd graphs built inside the block save for backward (a one-element list, filled on
    exit): every saved storage once, except weights (leaves that require gradients, or parameters, and their
    views), which a plain forward+backward holds anyway."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        root = t if t._base is None else t._base
        if not (isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad)):
            try:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
                storages[id(t)] = t.numel() * t.element_size()
        return t

    counted = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted
    counted[0] = sum(storages.values())


def measured_footprint(space: Space, model: nn.Module, vector: Tensor, activations: int) -> Footprint:
    """The :class:`Footprint` of a solve of ``model`` whose vectors are like ``vector``, with ``activations`` from
    :func:`saved_activation_bytes`. Every rank of a sharded run gets the same sums, so all take the same decision.

    Args:
        space: the perturbation space (its ``held_bytes``, summed over ranks with its ``total``).
        model: the model (its local shards under FSDP).
        vector: one solver vector.
        activations: the bytes the clean point's forward saved for its backward.

    Returns:
        The footprint, summed over the ranks."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    facts = torch.tensor(
        [vector.numel() * vector.element_size(), space.held_bytes, sum(p.numel() for p in local),
         sum(p.numel() * p.element_size() for p in local), activations],
        dtype=torch.float64, device=vector.device,
    )
    return Footprint(*(int(v) for v in space.total(facts).tolist()))


#: What a solver asks at its clean point: ``rule(vector, activations) -> keep the best point's gradient?``, with one
#: solver vector and the bytes the clean point's forward saved for its backward.
GradientRule = Callable[[Tensor, int], bool]


def gradient_rule(space: Space, model: nn.Module) -> GradientRule:
    """The memory decision for a solve of ``model`` over ``space``: :func:`keeps_best_gradient` on the footprint
    measured at the clean point (once per solve, before its first step).

    Args:
        space: the perturbation space.
        model: the model the objective evaluates.

    Returns:
        The rule :func:`hf_geosharp.engine.solvers.apgd.apgd` calls with its first vector and the clean point's
        activation bytes."""
    return _measured_rule(space, model, lambda footprint: keeps_best_gradient(footprint), "best point's gradient")


def clean_gradient_rule(space: Space, model: nn.Module) -> GradientRule:
    """As :func:`gradient_rule`, for the gradient at the clean point (:func:`keeps_clean_gradient`).

    Args:
        space: the perturbation space.
        model: the model the objective evaluates.

    Returns:
        The rule :func:`hf_geosharp.engine.solvers.apgd.apgd` calls with its first vector and the clean point's
        activation bytes."""
    return _measured_rule(space, model, lambda footprint: keeps_clean_gradient(footprint), "clean point's gradient")


def _measured_rule(space: Space, model: nn.Module, decide: Callable[[Footprint], bool], what: str) -> GradientRule:
    """``decide`` on the footprint measured when the solver asks, logged as ``what``."""

    def rule(vector: Tensor, activations: int) -> bool:
        footprint = measured_footprint(space, model, vector, activations)
        keep = decide(footprint)
        logger.debug("%s %s (%s)", what, "kept" if keep else "recomputed", footprint)
        return keep

    return rule
