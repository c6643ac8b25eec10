r"""The peers' curvature measures: the loss Hessian's largest eigenvalue and its trace.

The numbers PyHessian (Yao et al. 2020), hessian-eigenthings and curvlinops report, on the parameters the sharpness
measures perturb (:func:`~.model_function.objective.measured_parameters`; ``params="trainable"`` keeps those with
``requires_grad``) and, like them, per batch and averaged over the batches. For batch ``b`` with loss ``L_b`` and
Hessian ``H_b = d^2 L_b / dw^2``:

- :func:`hessian_top_eigenvalue`: ``lambda_max(H_b)`` by Lanczos on Hessian-vector products
  (:mod:`.lanczos`), certified by a measured residual and a second, deflated Lanczos that finds nothing larger
  (``_top_eigenvalue`` states the rule). Lanczos' largest Ritz value converges to the largest eigenvalue, not to the
  largest in magnitude, so a dominant negative end (away from a minimum) needs no shift.
- :func:`hessian_trace`: ``Tr(H_b)`` exactly (one product per parameter: small models only) or by Hutchinson's
  estimator ``E[v^T H_b v]`` over Rademacher vectors ``v`` (one product per sample), with the samples' standard error.

The value is the mean over batches of each batch's number (as for the sharpness measures); for the eigenvalue this is
at least the largest eigenvalue of the mean Hessian, which is what PyHessian reports over a whole dataset.

Each product is a double backward pass: one forward and one backward with ``create_graph=True`` per batch build the
gradient's graph, and each product differentiates ``<grad, v>`` once more through it (two to three gradients' cost).
The weights are replaced, for one batch at a time, by leaves that share their storage (the model is never written
to); modes, ``requires_grad``, ``.grad``, buffers and the config are restored afterwards
(:func:`~.model_function.objective.preserved_model_state`).

Attention kernels: PyTorch's fused scaled-dot-product kernels and flash attention have no double backward (the CPU
kernel's backward raises "derivative ... is not implemented"), so these measures run a transformers model with its
eager attention: every config whose ``_attn_implementation`` is another one is switched to ``"eager"`` for the call
and restored exactly afterwards (same function, another kernel). A model that calls a fused kernel by itself fails at
its first product with an error that names the fix. The gradient-only sharpness measures need no such switch.

Neither number is invariant under the attention symmetries: ``gs.reparametrize`` changes them (a GL(h) element
rescales the Hessian's blocks) while geodesic sharpness stays the same.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .._version import __version__
from . import result as _result
from .checks import check_inputs
from .defaults import N_SAMPLES, PARAMS, SEED
from .lanczos import lanczos
from .model_function.objective import (
    LossFn,
    default_loss,
    measured_parameters,
    preserved_model_state,
    refuse_reentrant_checkpointing,
    to_device,
)
from .placement.single import reparametrized
from .progress import bar_disabled
from .result import NotConvergedWarning, SharpnessResult, average_stderr, batch_stderr
from .runner import batch_seed
from .settings import PARAMS_CHOICES, Params

logger = logging.getLogger(__name__)

#: Largest number of Hessian-vector products of one Lanczos run (a batch makes at most two: the search and its check).
MAX_ITERS = 100
#: Relative residual bound of the top eigenvalue's certificate: ``||H y - theta y|| <= TOL |theta|``.
TOL = 1e-3
#: Attention implementations with a double backward; any other one is switched to ``"eager"`` for these measures.
DOUBLE_BACKWARD_ATTENTION = ("eager",)
#: Entries of the unit vectors batched into one product by the exact trace (``chunk x parameters``).
_CHUNK_ENTRIES = 1 << 22

Vector = list[Tensor]


def hessian_top_eigenvalue(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    max_iters: int = MAX_ITERS,
    tol: float = TOL,
    seed: int = SEED,
    params: Params = PARAMS,
    loss_fn: LossFn | None = None,
    progress: bool = True,
) -> SharpnessResult:
    """The largest eigenvalue of the loss Hessian, per batch by Lanczos, averaged over batches.

    Runs a transformers model with eager attention (fused SDPA and flash attention have no double backward): the
    config's ``_attn_implementation`` is switched for the call and restored exactly.

    Args:
        model: any ``nn.Module``; restored exactly afterwards (it runs in eval mode).
        batches: as for :func:`hf_geosharp.geodesic_sharpness`; the value is the mean over batches.
        max_iters: most Hessian-vector products per Lanczos run (a batch runs a search and a check: at most
            ``2 max_iters`` products).
        tol: the certificate, in every batch: the largest Ritz value has a measured relative residual
            ``||H y - theta y|| / |theta| <= tol`` (an eigenvalue lies within ``tol |theta|`` of it), and a second
            Lanczos from a fresh start, kept orthogonal to ``y``, settles no higher than ``theta (1 + tol)``
            (``_top_eigenvalue`` states the rule). Otherwise a ``NotConvergedWarning`` says why, and the value is a
            lower bound (a Rayleigh quotient).
        seed: seeds each batch's start vectors.
        params: ``"all"`` (default) or ``"trainable"`` (those with ``requires_grad``).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        progress: show a progress bar over the batches.

    Returns:
        ``SharpnessResult(measure="hessian_top_eigenvalue")``: ``stderr`` over batches, ``steps_used`` the most
        products any batch took, ``config["max_relative_residual"]`` the largest ``||H y - theta y|| / |theta|``
        (an eigenvalue of ``H`` lies within ``||H y - theta y||`` of ``theta``).
    """
    _check_count("max_iters", max_iters)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
        raise ValueError(f"tol must be a number in (0, 1), got {tol!r}.")
    _check_seed(seed)
    outcomes = _per_batch(model, batches, params, loss_fn, seed, progress, "hessian_top_eigenvalue",
                          lambda hessian, generator: _top_eigenvalue(hessian, generator, max_iters, tol))
    per_batch = [o[0] for o in outcomes]
    unconverged = [i for i, o in enumerate(outcomes) if not o[2]]
    note = None
    if unconverged:
        first = unconverged[0]
        note = (f"batch {first}: not certified at tol={tol:g} after {outcomes[first][1]} products: "
                f"{outcomes[first][4]}" + (f" (and {len(unconverged) - 1} more)" if len(unconverged) > 1 else ""))
        _warn(f"hessian_top_eigenvalue is not converged: {note}; raise max_iters (now {max_iters}) or tol"
              f"{' (from Python)' if _result.on_command_line() else ''}.")
    config = dict(estimator="lanczos", max_iters=max_iters, tol=tol, seed=seed, params=params,
                  n_batches=len(per_batch), max_relative_residual=max(o[3] for o in outcomes),
                  attn_implementation="eager", library=f"hf_geosharp {__version__}")
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, clean_loss=_mean([o[-1] for o in outcomes]),
        per_batch_clean_loss=[o[-1] for o in outcomes], measure="hessian_top_eigenvalue", config=config,
        stderr=batch_stderr(per_batch), converged=not unconverged, convergence_note=note,
        steps_used=max(o[1] for o in outcomes), certificate="not_certified" if unconverged else "certified",
    )


def hessian_trace(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    n_samples: int | None = N_SAMPLES,
    seed: int = SEED,
    params: Params = PARAMS,
    loss_fn: LossFn | None = None,
    progress: bool = True,
) -> SharpnessResult:
    """The trace of the loss Hessian per batch (Hutchinson's estimate, or exact), averaged over batches.

    Runs a transformers model with eager attention (fused SDPA and flash attention have no double backward): the
    config's ``_attn_implementation`` is switched for the call and restored exactly.

    Args:
        model: any ``nn.Module``; restored exactly afterwards (it runs in eval mode).
        batches: as for :func:`hf_geosharp.geodesic_sharpness`; the value is the mean over batches.
        n_samples: Rademacher vectors per batch (one Hessian-vector product each), or ``None``: the exact trace,
            one product per parameter (batched), for small models.
        seed: seeds the Rademacher vectors (per batch).
        params: ``"all"`` (default) or ``"trainable"`` (those with ``requires_grad``).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        progress: show a progress bar over the batches.

    Returns:
        ``SharpnessResult(measure="hessian_trace")``; ``stderr`` over batches and samples (Hutchinson: the sample
        standard error of the mean; with several batches the spread of the batch means), over batches (exact).
    """
    if n_samples is not None:
        _check_count("n_samples", n_samples)
    _check_seed(seed)

    def estimate(hessian: _BatchHessian, generator: torch.Generator) -> tuple[list[float]]:
        return ([hessian.exact_trace()] if n_samples is None else hessian.hutchinson(n_samples, generator),)

    outcomes = _per_batch(model, batches, params, loss_fn, seed, progress, "hessian_trace", estimate)
    samples = [o[0] for o in outcomes]
    per_batch = [sum(s) / len(s) for s in samples]
    config = dict(estimator="exact" if n_samples is None else "hutchinson", n_samples=n_samples, seed=seed,
                  mode="average", params=params, n_batches=len(per_batch), attn_implementation="eager",
                  library=f"hf_geosharp {__version__}")
    stderr = batch_stderr(per_batch) if n_samples is None else average_stderr(samples)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, clean_loss=_mean([o[-1] for o in outcomes]),
        per_batch_clean_loss=[o[-1] for o in outcomes], measure="hessian_trace", config=config, stderr=stderr,
        converged=True, steps_used=None,
    )


# ------------------------------------------------------------------------------------------------ the products
class _BatchHessian:
    """Hessian-vector products of one batch's loss: built by :func:`_batch_hessian` (forward and backward with
    ``create_graph=True`` once), then each product is one more backward through the gradient's graph."""

    def __init__(self, leaves: list[Tensor], loss: Tensor) -> None:
        grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        # A gradient that is None or has no graph is constant in the weights: its row of H (and column) is zero.
        self.live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self.grads = [grads[i] for i in self.live]
        self.leaves = leaves
        self.compute = torch.promote_types(leaves[0].dtype, torch.float32)
        self.products = 0

    def __call__(self, v: Vector) -> Vector:
        """``H v`` (``v`` and the result: one tensor per parameter, in the compute dtype)."""
        self.products += 1
        out = [torch.zeros_like(x) for x in v]
        if not self.live:
            return out
        try:
            hv = torch.autograd.grad(self.grads, [self.leaves[i] for i in self.live],
                                     [v[i].to(self.leaves[i].dtype) for i in self.live], retain_graph=True,
                                     allow_unused=True)
        except RuntimeError as error:
            raise _no_double_backward(error) from error
        for i, h in zip(self.live, hv):
            if h is not None:
                out[i] = h.to(self.compute)
        return out

    def flat(self, x: Tensor) -> Tensor:
        """``H x`` on flat vectors (the parameters' entries one after another)."""
        parts = [p.view(leaf.shape) for p, leaf in zip(x.split([leaf.numel() for leaf in self.leaves]), self.leaves)]
        return torch.cat([h.reshape(-1) for h in self(parts)])

    def flat_random(self, generator: torch.Generator) -> Tensor:
        """A Gaussian flat vector (:meth:`random`'s draw)."""
        return torch.cat([x.reshape(-1) for x in self.random(generator)])

    def random(self, generator: torch.Generator, rademacher: bool = False) -> Vector:
        """A random vector (Gaussian, or Rademacher), drawn on the CPU from ``generator`` in float64 so that the
        draw does not depend on the device."""
        out = []
        for leaf in self.leaves:
            if rademacher:
                x = torch.randint(0, 2, leaf.shape, generator=generator, dtype=torch.float64) * 2 - 1
            else:
                x = torch.randn(leaf.shape, generator=generator, dtype=torch.float64)
            out.append(x.to(device=leaf.device, dtype=self.compute))
        return out

    def hutchinson(self, n_samples: int, generator: torch.Generator) -> list[float]:
        """``n_samples`` draws ``v^T H v`` with Rademacher ``v`` (``E[v v^T] = I``: each draw is unbiased)."""
        draws = []
        for _ in range(n_samples):
            v = self.random(generator, rademacher=True)
            draws.append(_dot(v, self(v)))
        return draws

    def exact_trace(self) -> float:
        """``sum_i H[i, i]`` from the products with every unit vector, a chunk of them per batched backward."""
        sizes = [leaf.numel() for leaf in self.leaves]
        total = torch.zeros((), dtype=torch.float64, device=self.leaves[0].device)
        chunk = max(1, _CHUNK_ENTRIES // sum(sizes))
        for p in self.live:
            for start in range(0, sizes[p], chunk):
                index = torch.arange(start, min(start + chunk, sizes[p]), device=total.device)
                units = [torch.zeros((len(index), sizes[i]), dtype=self.leaves[i].dtype, device=total.device)
                         for i in self.live]
                units[self.live.index(p)][torch.arange(len(index)), index] = 1.0
                units = [u.view(len(index), *self.leaves[i].shape) for u, i in zip(units, self.live)]
                column = self._batched(units, self.live.index(p))  # [chunk, numel of p]: H E_i, p's block
                total += column[torch.arange(len(index)), index].double().sum()
                self.products += len(index)
        return float(total)

    def _batched(self, units: list[Tensor], which: int) -> Tensor:
        """The block of parameter ``which`` (of ``live``) of ``H u`` for every ``u`` of the batch: one vmapped double
        backward where every operation has a batching rule, else one product at a time."""
        inputs = [self.leaves[self.live[which]]]
        try:
            (hu,) = torch.autograd.grad(self.grads, inputs, units, retain_graph=True, is_grads_batched=True)
        except RuntimeError:  # an operation without a batching rule (or no double backward: raised below)
            try:
                hu = torch.stack([torch.autograd.grad(self.grads, inputs, [u[k] for u in units],
                                                      retain_graph=True)[0] for k in range(len(units[0]))])
            except RuntimeError as error:
                raise _no_double_backward(error) from error
        return hu.reshape(len(units[0]), -1)


def _top_eigenvalue(hessian: _BatchHessian, generator: torch.Generator, max_iters: int,
                    tol: float) -> tuple[float, int, bool, float, str]:
    """``(largest eigenvalue, products, certified, relative residual, why not certified)`` of one batch's Hessian.

    Lanczos (:func:`~.lanczos.lanczos`) from a seeded Gaussian start until its largest Ritz pair ``(theta, y)`` has
    a residual estimate ``<= tol |theta|``; one more product measures ``rho = ||H y - theta y||``, and an eigenvalue
    lies within ``rho`` of ``theta``. That it is the largest one is checked by a second Lanczos from a fresh start,
    kept orthogonal to ``y`` (on ``P H P``): certified when its largest Ritz pair ``theta'`` settles (residual
    ``<= tol max(|theta'|, |theta|)``) no higher than ``theta + tol |theta|``. No rule on products alone proves that
    no larger eigenvalue exists (a start orthogonal to its vector never sees it): the check is a second, independent
    look, from a start with a component along every eigenvector almost surely. A check that rises above the bound
    has found a larger eigenvalue (its Ritz values are Rayleigh quotients of ``H``): the search restarts from its
    vector, and the next check avoids both. An invariant Krylov space certifies on its own (its Ritz values are
    eigenvalues, the largest among them). Each run takes at most ``max_iters`` products, a batch at most
    ``2 max_iters``; the value is always a Rayleigh quotient, so never above the largest eigenvalue."""
    total = 2 * max_iters
    start, found, best = hessian.flat_random(generator), [], -math.inf
    while True:
        search = lanczos(hessian.flat, start, min(max_iters, total - hessian.products), tol)
        best = max(best, search.theta)
        residual = search.residual / max(abs(search.theta), 1e-300)
        if not search.settled:
            return best, hessian.products, False, residual, (
                f"the largest Ritz pair's relative residual is {residual:.2g} > tol after {search.products} products")
        if search.invariant:
            return search.theta, hessian.products, True, residual, ""
        if hessian.products >= total:
            return best, hessian.products, False, residual, "no product was left for the check"
        hy = hessian.flat(search.vector)
        residual = float(torch.linalg.vector_norm(hy - search.theta * search.vector)) / max(abs(search.theta), 1e-300)
        if residual > tol:
            return best, hessian.products, False, residual, f"the measured relative residual is {residual:.2g} > tol"
        found.append(_unit(search.vector - sum(((f @ search.vector) * f for f in found), torch.zeros_like(hy))))
        bound = search.theta + tol * abs(search.theta)
        if hessian.products >= total:
            return best, hessian.products, False, residual, "no product was left for the check"
        check = lanczos(hessian.flat, hessian.flat_random(generator), min(max_iters, total - hessian.products),
                        tol, floor=abs(search.theta), deflate=torch.stack(found), above=bound)
        best = max(best, check.theta)
        if check.settled:
            return search.theta, hessian.products, True, residual, ""
        if check.theta <= bound or hessian.products >= total:
            return best, hessian.products, False, residual, (
                "the check for a larger eigenvalue " + ("did not settle" if check.theta <= bound else
                                                        f"found {check.theta:.6g} > {search.theta:.6g}") +
                f" within {check.products} products")
        start = check.vector


def _unit(x: Tensor) -> Tensor:
    return x / torch.linalg.vector_norm(x)


def _dot(a: Vector, b: Vector) -> float:
    return float(sum((x * y).sum(dtype=torch.float64) for x, y in zip(a, b)))


# ------------------------------------------------------------------------------------------------ batches and state
def _per_batch(model: nn.Module, batches: Iterable[Any], params: Params, loss_fn: LossFn | None, seed: int,
               progress: bool, measure: str,
               work: Callable[[_BatchHessian, torch.Generator], tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``work(hessian, generator) + (clean loss,)`` for every batch, with the model in eval mode and eager attention,
    restored afterwards."""
    if params not in PARAMS_CHOICES:
        raise ValueError(f"params must be {' or '.join(repr(p) for p in PARAMS_CHOICES)}, got {params!r}.")
    batches = check_inputs(model, batches)
    names, tensors = measured_parameters(model)
    if any(hasattr(p, "to_local") for p in tensors):
        raise ValueError(f"{measure} does not run on a sharded (FSDP2/DTensor) model; measure it unsharded.")
    chosen = [(n, p) for n, p in zip(names, tensors) if params == "all" or p.requires_grad]
    if not chosen:
        raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
    loss_fn = loss_fn or default_loss
    device = chosen[0][1].device
    outcomes = []
    with preserved_model_state(model), eager_attention(model) as switched:
        if switched:
            logger.info("%s: attention switched from %s to eager for the call (no double backward in %s)", measure,
                        ", ".join(sorted(set(switched))), ", ".join(sorted(set(switched))))
        for index, batch in enumerate(tqdm(batches, desc=measure, unit="batch", disable=bar_disabled(progress))):
            torch.manual_seed(batch_seed(seed, index))  # the forked global RNG: random models repeat
            generator = torch.Generator().manual_seed(batch_seed(seed, index))
            with _batch_hessian(model, chosen, to_device(batch, device), loss_fn) as (hessian, clean):
                outcomes.append((*work(hessian, generator), clean))
    logger.info("%s: %s parameters, %d batch%s", measure, f"{sum(p.numel() for _, p in chosen):,}", len(batches),
                "" if len(batches) == 1 else "es")
    return outcomes


@contextlib.contextmanager
def _batch_hessian(model: nn.Module, chosen: list[tuple[str, Tensor]], batch: Any,
                   loss_fn: LossFn) -> Iterator[tuple[_BatchHessian, float]]:
    """The products of one batch and its clean loss. The weights are swapped for leaves that share their storage
    while the block is open (a non-reentrant checkpoint recomputes its forward during the products)."""
    leaves = [p.detach().requires_grad_(True) for _, p in chosen]
    with torch.enable_grad(), reparametrized(model, {n: leaf for (n, _), leaf in zip(chosen, leaves)}):
        loss = loss_fn(model, batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("The loss must be a scalar tensor (a mean over the batch).")
        if not math.isfinite(clean := float(loss.detach())):
            raise FloatingPointError(f"The loss is {clean} at the model's weights; check the inputs and labels.")
        if not loss.requires_grad:
            raise TypeError(
                "The loss does not depend on the model's parameters (it has no autograd graph); a loss_fn must "
                "compute it from `model(...)` outputs without detaching or using torch.no_grad()."
            )
        refuse_reentrant_checkpointing(loss)
        try:
            hessian = _BatchHessian(leaves, loss.reshape(()))
        except RuntimeError as error:
            raise _no_double_backward(error) from error
        yield hessian, clean


def attention_implementations(model: nn.Module) -> dict[int, tuple[Any, str]]:
    """``{id(config): (config, its attention implementation)}`` of every transformers config the model reads (each
    module's ``config`` and the configs inside them, e.g. ``text_config``) that names one."""
    found: dict[int, tuple[Any, str]] = {}
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        config = stack.pop()
        if config is None or isinstance(config, nn.Module) or not hasattr(config, "to_dict") or id(config) in found:
            continue
        impl = getattr(config, "_attn_implementation", None)
        found[id(config)] = (config, impl if isinstance(impl, str) else "")
        stack.extend(v for v in vars(config).values() if hasattr(v, "to_dict") and not isinstance(v, nn.Module))
    return {k: v for k, v in found.items() if v[1]}


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[list[str]]:
    """Run ``model`` with eager attention inside the block: every config whose ``_attn_implementation`` is not one
    with a double backward (:data:`DOUBLE_BACKWARD_ATTENTION`) is set to ``"eager"``, and every attribute of those
    configs is restored exactly afterwards, whatever happens. Yields the implementations that were switched."""
    switched = [(config, impl) for config, impl in attention_implementations(model).values()
                if impl not in DOUBLE_BACKWARD_ATTENTION]
    saved = [(config, dict(vars(config))) for config, _ in switched]
    try:
        for config, _ in switched:
            config._attn_implementation = "eager"
        yield [impl for _, impl in switched]
    finally:
        for config, attributes in saved:
            vars(config).clear()
            vars(config).update(attributes)


def _no_double_backward(error: RuntimeError) -> RuntimeError:
    """The error of a graph without a second derivative (a fused attention kernel), naming the fix; others as
    they are."""
    text = str(error)
    if "derivative for" not in text and "double backward" not in text and "twice differentiable" not in text:
        return error
    return RuntimeError(
        f"Hessian-vector products need a double backward, which an operation of this model lacks ({text.strip()}). "
        "Fused attention kernels (scaled_dot_product_attention's flash/efficient kernels, flash-attn) have none: load "
        "the model with attn_implementation='eager' (transformers switches its own models automatically; a model "
        "that calls such a kernel itself must offer an eager path)."
    )


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}.")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _warn(message: str) -> None:
    """A :class:`NotConvergedWarning`, or a note for :func:`~.result.collected_convergence_notes`."""
    if _result._collectors:
        _result._collectors[-1].append(message)
        return
    _result.warn_at_caller(message, NotConvergedWarning)
