"""The model as a function of the perturbation, and the guarantee that the user's model is left as it was.

:class:`Objective` evaluates the loss at perturbed weights and its gradient with respect to the perturbation; how the
model is made to compute with the perturbed weights, and how their gradients come back, is its placement's
(:mod:`hf_geosharp.engine.placement`). :func:`preserved_model_state` restores modes, ``requires_grad``, ``.grad``,
buffers, config attributes and the RNG in a ``finally`` block, so the guarantee also holds on exceptions and
``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..checks import non_finite_loss
from ..space.perturbation_space import PerturbationSpace

if TYPE_CHECKING:
    from ..placement.base import Placement

#: ``loss_fn(model, batch) -> scalar tensor``: how a batch's loss is computed (default: :func:`default_loss`).
LossFn = Callable[[nn.Module, Any], Tensor]


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
    """The loss a transformers model returns for ``model(**batch)`` (the batch holds the labels), with an error that
    says what to do when there is none."""
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
    """``batch`` with its tensors (also inside a dict) moved to ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Objective:
    """``(xi, need_grad, out=None) -> (loss, dloss/dxi)`` at weights ``Exp(w; xi)`` on the current ``batch``.

    ``out`` is one flat buffer that serves the whole evaluation: the perturbed weights are written into it
    (``space.exp_point``), the placement has the model compute with them (the user's parameters are never
    touched), and during the backward pass it writes each parameter's gradient over that parameter's weights as soon
    as it is ready (nothing reads them again), so weights and gradient share one buffer; the derivative of the
    geodesic's curvature terms is then applied in place by the space's pullback.

    Args:
        model: the model ``loss_fn`` is called with.
        space: the perturbation space (its vectors are laid out as ``placement`` holds the parameters).
        placement: where the vectors live and how the perturbed weights reach the model
            (:class:`~hf_geosharp.engine.placement.base.Placement`, after its ``hold``).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        rho: the radius, for error messages.
    """

    def __init__(self, model: nn.Module, space: PerturbationSpace, placement: Placement, loss_fn: LossFn,
                 rho: float) -> None:
        self.model, self.space, self.placement, self.loss_fn, self.rho = model, space, placement, loss_fn, rho
        self.batch: Any = None
        self.graph_checked = False
        self._buffer: Tensor | None = None  # the perturbed weights of gradient-free calls that pass no ``out``

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        """The loss at ``Exp(w; xi)``, and with ``need_grad`` its gradient in ``xi`` (in ``out`` when given)."""
        value, grad = self.on_device(xi, need_grad, out)
        loss = float(value)
        self._check_finite(loss, xi)
        return loss, grad

    def on_device(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """As a call, with the loss a detached 0-dim tensor the host does not read (its finiteness is the caller's
        to check: the solver checks the losses it reads once per check)."""
        out = self._buffer_for(out, need_grad)
        pullback = self.space.exp_point(xi, out, need_grad)
        with torch.set_grad_enabled(need_grad), self.placement.substituted(out, need_grad) as backward:
            loss, value, differentiated = self._loss()
            if not need_grad:
                return value, None
            self._check_graph(loss)
            backward(differentiated)
        if pullback is not None:
            pullback(out)
        return value, out

    @contextlib.contextmanager
    def pending(self, xi: Tensor, out: Tensor) -> Iterator[tuple[Tensor, Callable[[], None]]]:
        """As :meth:`on_device` with the gradient left pending: yields the loss (a detached 0-dim tensor) and a
        function that takes the gradient, into ``out``, from the forward's graph (kept while inside). Take it or
        not once the loss is known: a solver's last iterate needs its gradient only where it is the best point, and
        this spares the forward that a separate call for it would repeat. ``out`` holds the gradient in ``xi`` after
        the block, where it was taken."""
        pullback = self.space.exp_point(xi, out, True)
        taken = False
        with torch.enable_grad(), self.placement.substituted(out, True) as backward:
            loss, value, differentiated = self._loss()

            def take() -> None:
                nonlocal taken
                self._check_graph(loss)
                backward(differentiated)
                taken = True

            yield value, take
        if taken and pullback is not None:
            pullback(out)

    def _loss(self) -> tuple[Tensor, Tensor, Tensor]:
        """The batch's loss with the perturbed weights swapped in: the loss function's tensor, its value (detached,
        float32 for a half model: exactly) and the tensor to differentiate (:meth:`Placement.batch_loss`)."""
        loss = self.loss_fn(self.model, self.batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("The loss must be a scalar tensor (a mean over the batch).")
        value, differentiated = self.placement.batch_loss(loss, self.batch)
        if value.dtype in (torch.float16, torch.bfloat16):  # a half model's loss, read in float32 (exactly)
            value = value.float()
        return loss, value, differentiated

    def _buffer_for(self, out: Tensor | None, need_grad: bool) -> Tensor:
        """``out``, or a fresh buffer for a gradient the caller keeps, or the reused one of gradient-free calls."""
        if out is not None:
            return out
        if need_grad:
            return self.space.empty()
        if self._buffer is None:
            self._buffer = self.space.empty()
        return self._buffer

    def _check_finite(self, value: float, xi: Tensor) -> None:
        if not math.isfinite(value):
            raise non_finite_loss(value, None if not bool(xi.any()) else self.rho)

    def _check_graph(self, loss: Tensor) -> None:
        """Refuse a loss without a graph, or (once per run: the graph's structure does not change between steps)
        with reentrant checkpoints: neither gives the gradient."""
        if not loss.requires_grad:
            raise TypeError(
                "The loss does not depend on the model's parameters (it has no autograd graph); a loss_fn must "
                "compute it from `model(...)` outputs without detaching or using torch.no_grad()."
            )
        if not self.graph_checked:
            refuse_reentrant_checkpointing(loss)
            self.graph_checked = True


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
