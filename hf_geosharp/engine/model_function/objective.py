"""The model as a function of the perturbation, and the guarantee that the user's model is left as it was.

The loss at perturbed weights is evaluated through stateless reparametrisation (:func:`reparametrized`: the
model's parameters are swapped for other tensors for the duration of one call, tied weights included), gradients
are taken with respect to those tensors only, and :func:`preserved_model_state` restores modes, ``requires_grad``,
``.grad``, buffers, config attributes and the RNG in a ``finally`` block, so the guarantee also holds on exceptions
and ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import stateless

from ..space.perturbation_space import PerturbationSpace
from .embedding_rows import RowLookup, UsedRows

LossFn = Callable[[nn.Module, Any], Tensor]


@contextlib.contextmanager
def reparametrized(model: nn.Module, tensors: Mapping[str, Tensor], tie_weights: bool = True) -> Iterator[None]:
    """``model`` computes with ``tensors`` (by parameter name) in place of its parameters inside the block (with
    ``tie_weights``, also in place of the parameters tied to them).

    The one use of PyTorch's private ``_reparametrize_module`` (the engine of ``torch.func.functional_call``, which
    cannot keep the swap open across a separate backward pass, as activation checkpointing needs); its behaviour
    is pinned by a test, so a change in PyTorch shows up there first."""
    with stateless._reparametrize_module(model, tensors, tie_weights=tie_weights):
        yield


@contextlib.contextmanager
def preserved_model_state(model: nn.Module) -> Iterator[None]:
    """Put the model in eval mode and restore, whatever happens (exceptions and Ctrl-C included): modes,
    ``requires_grad``, ``.grad``, buffers (bit-exact, also when a forward replaces or adds one), the attributes a
    forward writes on the config (transformers sets ``config.problem_type`` from the labels' dtype) and the global
    torch RNG (CPU and the model's CUDA devices), which is forked: the caller's random stream is left where it was,
    and the runner seeds it per batch, so a model that draws random numbers in eval mode gives the same bits for the
    same seed."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "called inside torch.inference_mode(); gradients are needed to search the perturbation ball. Call it "
            "outside the `with torch.inference_mode():` block (torch.no_grad() around it is fine)."
        )
    modes = [(m, m.training) for m in model.modules()]
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    buffers = [(m, dict(m._buffers), {k: b.detach().clone() for k, b in m._buffers.items() if b is not None})
               for m in model.modules()]
    configs = {id(c): (c, dict(vars(c))) for m in model.modules() if _is_config(c := getattr(m, "config", None))}
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            model.eval()
            yield
        finally:
            for module, training in modes:
                module.training = training
            for p, flag, grad in zip(params, flags, grads):
                if p.requires_grad != flag:
                    p.requires_grad_(flag)
                p.grad = grad
            with torch.no_grad():
                for module, originals, values in buffers:
                    module._buffers.clear()
                    module._buffers.update(originals)
                    for name, value in values.items():
                        if originals[name].shape == value.shape:
                            originals[name].copy_(value)
                        else:  # resized in place
                            originals[name].set_(value)
            for config, attributes in configs.values():
                vars(config).clear()
                vars(config).update(attributes)


def _is_config(obj: Any) -> bool:
    """A transformers-style config (its attributes are what a forward may write, e.g. ``problem_type``)."""
    return obj is not None and hasattr(obj, "to_dict") and hasattr(obj, "__dict__") and not isinstance(obj, nn.Module)


def measured_parameters(model: nn.Module) -> tuple[list[str], list[Tensor]]:
    """The model's parameters by name (tied ones once), refused before any work if no number can come out: none at
    all, on the meta device, not floating point, NaN or inf."""
    named = list(model.named_parameters())
    if not named:
        raise ValueError("The model has no parameters to perturb.")
    for name, p in named:
        if p.is_meta:
            raise ValueError(
                f"Parameter {name!r} is on the meta device (no data). Load the weights first, e.g. "
                "`from_pretrained(...)` without `device_map='meta'`, or `model.to_empty(device=...)` and load a "
                "state dict."
            )
        if not p.is_floating_point():
            raise ValueError(f"Parameter {name!r} has dtype {p.dtype}; sharpness needs floating-point weights.")
    for name, p in named:  # one read pass per parameter: NaN and inf propagate into the sum
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local.detach().sum()) and not bool(torch.isfinite(local.detach()).all()):
            raise ValueError(f"Parameter {name!r} has NaN or inf entries; sharpness is undefined for such weights.")
    return [n for n, _ in named], [p for _, p in named]


def default_loss(model: nn.Module, batch: Any) -> Tensor:
    if not isinstance(batch, Mapping):
        raise TypeError(
            "A batch must be a dict of model inputs (labels included) when no loss_fn is given; "
            f"got {type(batch).__name__}."
        )
    outputs = model(**batch)
    if isinstance(outputs, (tuple, list)):  # return_dict=False: transformers puts the loss first when labels are given
        first = outputs[0] if outputs else None
        if isinstance(first, Tensor) and first.dim() == 0:
            return first
        raise ValueError(
            "The model returned a tuple (return_dict=False) whose first element is not a scalar loss"
            + (" although the batch has labels" if "labels" in batch else "; include `labels` in each batch")
            + ". Load it with return_dict=True (the default), or pass `loss_fn(model, batch) -> scalar tensor`."
        )
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            "The model returned no loss"
            + (" although the batch has labels" if "labels" in batch else "; include `labels` in each batch")
            + ". Pass `loss_fn(model, batch) -> scalar tensor` to say how to compute it."
        )
    return loss


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Objective:
    """``(xi, need_grad, out=None) -> (loss, dloss/dxi)`` at weights ``Exp(w; xi)`` on the current ``batch``.

    ``out`` is one flat buffer that serves the whole evaluation: the perturbed weights are written into it
    (``space.exp_point``) and its per-parameter views are swapped into the model for one call (the user's parameters
    are never touched); during the backward pass each parameter's gradient is copied over that parameter's weights as
    soon as it is ready (nothing reads them again), so weights and gradient share one buffer; the derivative of the
    geodesic's curvature terms is then applied in place by the space's pullback. The swapped-in views are separate
    tensor objects, each with its own version counter, so writing one parameter's gradient does not invalidate the
    others; after the write the view's counter is bumped, so that a model that did read a weight again after its
    gradient was final would fail loudly instead of computing with the gradient.

    Args:
        names, params: the parameters the space covers (its base segments, in order); the others stay the model's.
        used_rows: ``{position in params: rows}`` for embedding weights of which the space holds only the rows the
            batches look up (:mod:`hf_geosharp.engine.model_function.embedding_rows`); their lookups read the perturbed
            rows, and the model keeps its own weight.
    """

    def __init__(
        self, model: nn.Module, names: list[str], params: list[Tensor], space: PerturbationSpace, loss_fn: LossFn,
        rho: float, used_rows: dict[int, UsedRows] | None = None,
    ) -> None:
        self.model, self.space, self.loss_fn, self.rho = model, space, loss_fn, rho
        self.batch: Any = None
        self.names, self.params = names, params
        self.used_rows = used_rows or {}
        self.shapes = [torch.Size((self.used_rows[i].rows.numel(), *p.shape[1:])) if i in self.used_rows else p.shape
                       for i, p in enumerate(params)]
        self.numels = [shape.numel() for shape in self.shapes]
        self.offsets = [0, *torch.tensor(self.numels).cumsum(0).tolist()][:-1]
        self.graph_checked = False
        self._buffer: Tensor | None = None  # the perturbed weights of gradient-free calls that pass no ``out``

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        out = self._buffer_for(out, need_grad)
        pullback = self.space.exp_point(xi, out, need_grad)
        tensors, leaves, looked_up = {}, [], {}
        for i, (name, p, offset, shape) in enumerate(zip(self.names, self.params, self.offsets, self.shapes)):
            t = _aliased(out, offset, shape)
            if t.dtype != p.dtype:  # a half-precision model computes with its own dtype (a copy)
                t = t.to(p.dtype)
            if need_grad:
                leaves.append(t.requires_grad_(True))
            if i in self.used_rows:
                looked_up[id(p)] = (self.used_rows[i], t)
            else:
                tensors[name] = t
        lookups = RowLookup(looked_up) if looked_up else contextlib.nullcontext()
        # Backward runs inside the reparametrisation too: activation checkpointing recomputes the forward during
        # backward, and must see the perturbed weights, not the user's.
        with torch.set_grad_enabled(need_grad), reparametrized(self.model, tensors), lookups:
            loss = self.loss_fn(self.model, self.batch)
            value = self._checked_value(loss, xi)
            if not need_grad:
                return value, None
            self._backward(loss, leaves, out)
        if pullback is not None:
            pullback(out)
        return value, out

    def _buffer_for(self, out: Tensor | None, need_grad: bool) -> Tensor:
        """``out``, or a fresh buffer for a gradient the caller keeps, or the reused one of gradient-free calls."""
        if out is not None:
            return out
        if need_grad:
            return self.space.empty()
        if self._buffer is None:
            self._buffer = self.space.empty()
        return self._buffer

    def _checked_value(self, loss: Any, xi: Tensor) -> float:
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("The loss must be a scalar tensor (a mean over the batch).")
        value = float(loss.detach())
        if not math.isfinite(value):
            where = "the unperturbed weights" if not bool(xi.any()) else f"a perturbed point (rho={self.rho})"
            hint = "check the inputs and labels" if "unperturbed" in where else "lower rho"
            raise FloatingPointError(f"The loss is {value} at {where}; {hint}.")
        return value

    def _backward(self, loss: Tensor, leaves: list[Tensor], out: Tensor) -> None:
        """``dloss/dtheta`` into ``out``, streamed parameter by parameter over the weights (zero where no gradient
        arrives)."""
        if leaves and not loss.requires_grad:
            raise TypeError(
                "The loss does not depend on the model's parameters (it has no autograd graph); a loss_fn must "
                "compute it from `model(...)` outputs without detaching or using torch.no_grad()."
            )
        if not self.graph_checked:  # once per run: the graph's structure does not change between steps
            refuse_reentrant_checkpointing(loss)
            self.graph_checked = True
        segments, filled = out.split(self.numels), set()

        def stream(position: int) -> Callable[[Tensor], None]:
            # Copy each gradient into the flat buffer as soon as backward has it, and drop it: the per-parameter
            # gradients are then never all alive at once (a plain backward keeps them all in .grad).
            def hook(leaf: Tensor) -> None:
                segments[position].copy_(leaf.grad.reshape(-1))
                leaf.grad = None
                torch.autograd.graph.increment_version(leaf)
                filled.add(position)

            return hook

        for position, leaf in enumerate(leaves):
            leaf.register_post_accumulate_grad_hook(stream(position))
        torch.autograd.backward(loss, inputs=leaves)
        missing = [segment for i, segment in enumerate(segments) if i not in filled]
        if missing:
            torch._foreach_zero_(missing)


def _aliased(flat: Tensor, offset: int, shape: torch.Size) -> Tensor:
    """A contiguous tensor of ``shape`` on ``flat``'s memory at ``offset``, with a version counter of its own (a
    view would share ``flat``'s, and writing one parameter's gradient would then invalidate every other)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    storage, start = flat.untyped_storage(), flat.storage_offset() + offset
    return flat.new_empty(0).set_(storage, start, shape, tuple(reversed(strides)))


def refuse_reentrant_checkpointing(loss: Tensor) -> None:
    """Raise if the graph holds reentrant activation checkpoints: their weights are hidden from the outer graph, so
    a backward restricted to the perturbation's leaves (``inputs=``) would silently miss their gradients."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise ValueError(
                "The model uses reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) "
                "in evaluation mode, which hides the weights from the gradients sharpness needs. Switch it off "
                "(model.gradient_checkpointing_disable()) or use use_reentrant=False."
            )
        stack.extend(next_node for next_node, _ in node.next_functions)
