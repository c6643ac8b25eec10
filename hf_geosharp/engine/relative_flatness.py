r"""Relative flatness (Petzka et al., NeurIPS 2021, "Relative Flatness and Generalization"), trace version.

For the weight matrix ``W`` (``m x d``, rows ``w_s``) of the layer that maps the features to the outputs,

    kappa_Tr(W) = sum_{s, s'} <w_s, w_s'> Tr(H_{s,s'}),   H_{s,s'} = d^2 L / (d w_s d w_s')   (d x d blocks).

By default it is computed exactly: ``Tr(H_{s,s'}) = sum_j H[(s, j), (s', j)]``, so the ``m d`` Hessian-vector
products with the unit matrices ``E_{s' j}`` give every trace (column ``j`` of ``H E_{s' j}``); they are batched
(``is_grads_batched``) a chunk at a time. For the classifier of a sequence or image model (``m`` labels, ``d`` a few
hundred features) that is a few hundred cheap products: the features do not depend on ``W``, so each product only
runs through the head. ``n_samples=k`` estimates it instead (Hutchinson): for ``V = c u^T`` with ``c = W z``,
``z ~ N(0, I_d)`` (so ``E[c c^T] = W W^T``) and ``u`` Rademacher in ``R^d`` (so ``E[u u^T] = I``),
``E[vec(V)^T H vec(V)] = sum_{s,s'} (W W^T)_{s s'} Tr(H_{s,s'})``, one product per sample. The Hessian-vector
products are double backward passes through a stateless call (the layer's weight is swapped for a leaf for the
duration of one call), so the model is never written to.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .._version import __version__
from .checks import check_batch, check_model
from .defaults import SEED
from .model_function.objective import LossFn, default_loss, preserved_model_state, to_device
from .placement.single import reparametrized
from .result import SharpnessResult, average_stderr, batch_stderr
from .runner import batch_seed

logger = logging.getLogger(__name__)


def feature_layer(model: nn.Module, layer: str | nn.Linear | None = None) -> tuple[str, nn.Linear]:
    """``(name, module)`` of the layer whose weight relative flatness looks at: ``layer`` (a module name or the
    module itself), or by default the model's last ``nn.Linear`` (the classification head of a ``...ForSequence``/
    ``...ForImageClassification`` model, which reads the features)."""
    named = dict(model.named_modules())
    if isinstance(layer, str):
        if layer not in named:
            raise ValueError(f"layer {layer!r} is not a module of the model; pass e.g. 'classifier'.")
        module = named[layer]
        name = layer
    elif isinstance(layer, nn.Module):
        name = next((n for n, m in named.items() if m is layer), None)
        if name is None:
            raise ValueError("layer is not a module of this model.")
        module = layer
    elif layer is None:
        linears = [(n, m) for n, m in named.items() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError(
                "The model has no nn.Linear layer; pass layer='<name of the layer that reads the features>'."
            )
        name, module = linears[-1]
    else:
        raise TypeError(f"layer must be a module name, an nn.Linear or None, got {type(layer).__name__}.")
    if not isinstance(module, nn.Linear):
        raise ValueError(f"layer {name!r} is a {type(module).__name__}; relative flatness needs an nn.Linear.")
    return name, module


def relative_flatness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layer: str | nn.Linear | None = None,
    n_samples: int | None = None,
    seed: int = SEED,
    loss_fn: LossFn | None = None,
) -> SharpnessResult:
    """Relative flatness ``kappa_Tr`` of the feature layer (Petzka et al. 2021), exact per batch by default.

    Args:
        model: any ``nn.Module``; restored exactly afterwards (it runs in eval mode).
        batches: as for :func:`hf_geosharp.geodesic_sharpness`; the value is the mean over batches.
        layer: the ``nn.Linear`` that reads the features (name or module); default: the model's last one.
        n_samples: ``None`` (default): the exact trace (``m d`` Hessian-vector products per batch for an ``m x d``
            layer). An integer: a Hutchinson estimate from that many samples per batch (one product each).
        seed: seeds the Hutchinson samples (per batch).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.

    Returns:
        ``SharpnessResult(measure="relative_flatness")``; ``stderr`` over batches (exact), or over batches and
        samples (Hutchinson).
    """
    if n_samples is not None and (isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1):
        raise ValueError(f"n_samples must be None (the exact trace) or a positive integer, got {n_samples!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    batches = list(batches)
    if not batches:
        raise ValueError("No batches were given; pass a non-empty list of batches (dicts of model inputs with labels).")
    check_model(model)
    for i, batch in enumerate(batches):
        check_batch(model, batch, i)
    name, module = feature_layer(model, layer)
    key = f"{name}.weight" if name else "weight"
    loss_fn = loss_fn or default_loss
    per_batch, per_clean, samples = [], [], []
    with preserved_model_state(model):
        W = module.weight.detach()
        compute = torch.promote_types(W.dtype, torch.float32)
        for index, batch in enumerate(batches):
            batch = to_device(batch, W.device)
            leaf = W.clone().requires_grad_(True)
            with torch.enable_grad(), reparametrized(model, {key: leaf}, tie_weights=False):
                loss = loss_fn(model, batch)
                (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
                if n_samples is None:
                    draws = [exact_trace(grad, leaf, W.to(compute))]
                else:
                    draws = _hutchinson(grad, leaf, W, n_samples, batch_seed(seed, index), compute)
            del grad, loss
            per_batch.append(sum(draws) / len(draws))
            per_clean.append(float(_clean_loss(model, batch, loss_fn)))
            samples.append(draws)
    logger.info("relative_flatness: layer %s (%d x %d), %d batch%s", name, *W.shape, len(batches),
                "" if len(batches) == 1 else "es")
    config = dict(layer=name, n_samples=n_samples, estimator="exact" if n_samples is None else "hutchinson", seed=seed,
                  mode="average", n_batches=len(batches), library=f"hf_geosharp {__version__}")
    stderr = batch_stderr(per_batch) if n_samples is None else average_stderr(samples)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, clean_loss=sum(per_clean) / len(per_clean),
        per_batch_clean_loss=per_clean, measure="relative_flatness", config=config, stderr=stderr,
        converged=True, steps_used=None,
    )


#: Entries of the Hessian-vector products batched at once by :func:`exact_trace` (``chunk x m x d``).
_CHUNK_ENTRIES = 1 << 22


def exact_trace(grad: Tensor, leaf: Tensor, W: Tensor) -> float:
    """``sum_{s,s'} (W W^T)_{s s'} Tr(H_{s,s'})`` from the ``m d`` products ``H E_{s' j}`` (``grad`` is ``dL/dW`` with
    its graph, ``leaf`` the weight it was taken at)."""
    m, d = leaf.shape
    gram = W @ W.T  # (W W^T)_{s s'}
    total = torch.zeros((), dtype=gram.dtype, device=gram.device)
    chunk = max(1, _CHUNK_ENTRIES // (m * d))
    units = [(s, j) for s in range(m) for j in range(d)]
    for start in range(0, len(units), chunk):
        part = units[start : start + chunk]
        rows = torch.tensor([s for s, _ in part], device=leaf.device)
        cols = torch.tensor([j for _, j in part], device=leaf.device)
        E = torch.zeros((len(part), m, d), dtype=leaf.dtype, device=leaf.device)
        E[torch.arange(len(part)), rows, cols] = 1.0
        HE = _batched_products(grad, leaf, E).to(gram.dtype)  # [chunk, m, d]
        column = HE[torch.arange(len(part)), :, cols]  # [chunk, m]: H[(s, j), (s', j)] for every s
        total += (column * gram[:, rows].T).sum()
    return float(total)


def _batched_products(grad: Tensor, leaf: Tensor, E: Tensor) -> Tensor:
    """``H E[i]`` for every ``i``, in one vmapped double backward where the graph allows it, else one by one."""
    try:
        (HE,) = torch.autograd.grad(grad, leaf, E, retain_graph=True, is_grads_batched=True)
        return HE
    except RuntimeError:  # an operation without a batching rule
        return torch.stack([torch.autograd.grad(grad, leaf, e, retain_graph=True)[0] for e in E])


def _hutchinson(grad: Tensor, leaf: Tensor, W: Tensor, n_samples: int, seed: int, compute: torch.dtype) -> list[float]:
    """``n_samples`` Hutchinson draws ``vec(V)^T H vec(V)``, ``V = (W z) u^T`` (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(n_samples):
        z = torch.randn(W.shape[1], generator=generator, dtype=torch.float64)
        u = torch.randint(0, 2, (W.shape[1],), generator=generator, dtype=torch.float64) * 2 - 1
        V = torch.outer(W.double() @ z.to(W.device), u.to(W.device)).to(W.dtype)
        (hv,) = torch.autograd.grad(grad, leaf, V, retain_graph=True)
        draws.append(float((V.to(compute) * hv.to(compute)).sum()))
    return draws


@torch.no_grad()
def _clean_loss(model: nn.Module, batch: Any, loss_fn: LossFn) -> Tensor:
    return loss_fn(model, batch).detach()
