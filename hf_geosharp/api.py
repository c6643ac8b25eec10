"""Public entry points: :func:`geodesic_sharpness` and :func:`adaptive_sharpness`.

The runner turns a model and batches into a perturbation space and an objective, runs a solver per batch, and
collects a :class:`SharpnessResult`. The user's model is never mutated: the loss at perturbed weights is evaluated
through ``torch.nn.utils.stateless`` reparametrisation (which swaps parameters for the duration of one call and handles
tied weights), gradients are taken with ``torch.autograd.grad`` with respect to the perturbation only, and train/eval
mode, ``requires_grad`` and ``.grad`` are restored in a ``finally`` block, so the guarantee also holds on exceptions
and ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from tqdm.auto import tqdm

from . import __version__
from .geometry.elementwise import Curvature
from .solver import SolveResult, StepNormalization, apgd, apgd_as23, average_case
from .space import PerturbationSpace, SpaceOptions
from .symmetry.base import SymmetryMap

logger = logging.getLogger(__name__)

Mode = Literal["worst", "average"]
LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class SharpnessResult:
    """A sharpness measurement.

    Attributes:
        value: mean over batches of (max or mean perturbed loss) minus clean loss.
        per_batch: the value of each batch, in batch order.
        clean_loss: mean clean loss over batches.
        per_batch_clean_loss: the clean loss of each batch.
        measure: e.g. ``"geodesic_inv_worst"`` or ``"adaptive_as23_worst"``.
        config: every setting that determines the number (rho, steps, seed, epsilon, ...).
    """

    value: float
    per_batch: list[float]
    clean_loss: float
    per_batch_clean_loss: list[float]
    measure: str
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.measure}: {self.value:.6g} (clean loss {self.clean_loss:.6g}, {len(self.per_batch)} batches, "
            f"rho={self.config.get('rho')})"
        )


# ---------------------------------------------------------------------- model safety
@contextlib.contextmanager
def preserved_model_state(model: nn.Module) -> Iterator[None]:
    """Put the model in eval mode and restore modes, ``requires_grad`` and ``.grad`` afterwards, whatever happens."""
    modes = [(m, m.training) for m in model.modules()]
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
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


def _flat_parameters(model: nn.Module) -> tuple[list[str], list[Tensor], Tensor]:
    """Names, tensors and the flat working copy ``theta0`` (fp32 for half-precision weights, else their dtype)."""
    named = list(model.named_parameters())
    if not named:
        raise ValueError("The model has no parameters to perturb.")
    names, params = [n for n, _ in named], [p for _, p in named]
    for name, p in named:
        if p.is_meta:
            raise ValueError(
                f"Parameter {name!r} is on the meta device (no data). Load the weights first, e.g. "
                "`from_pretrained(...)` without `device_map='meta'`, or `model.to_empty(device=...)` and load a state dict."
            )
        if not p.is_floating_point():
            raise ValueError(f"Parameter {name!r} has dtype {p.dtype}; sharpness needs floating-point weights.")
    work_dtype = torch.promote_types(torch.float32, max((p.dtype for p in params), key=lambda d: torch.finfo(d).bits))
    theta0 = torch.cat([p.detach().reshape(-1).to(work_dtype) for p in params])
    bad = ~torch.isfinite(theta0)
    if bad.any():
        offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)
        first = int(torch.searchsorted(offsets, bad.nonzero()[0, 0], right=True)) - 1
        raise ValueError(f"Parameter {names[first]!r} has NaN or inf entries; sharpness is undefined for such weights.")
    return names, params, theta0


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"A batch must be a dict of model inputs (labels included) when no loss_fn is given; got {type(batch).__name__}."
        )
    outputs = model(**batch)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            "The model returned no loss. Include `labels` in each batch, or pass `loss_fn(model, batch) -> scalar tensor`."
        )
    return loss


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class _Objective:
    """``(xi, need_grad) -> (loss, dloss/dxi)`` on one batch at weights ``theta0 + displacement(xi)``."""

    def __init__(self, model, names, params, space: PerturbationSpace, batch, loss_fn: LossFn, rho: float) -> None:
        self.model, self.space, self.batch, self.loss_fn, self.rho = model, space, batch, loss_fn, rho
        self.layout = [(n, p.shape, p.dtype, p.numel()) for n, p in zip(names, params)]

    def __call__(self, xi: Tensor, need_grad: bool) -> tuple[float, Tensor | None]:
        if need_grad:
            xi = xi.detach().requires_grad_(True)
        with torch.set_grad_enabled(need_grad):
            theta = self.space.theta0 + self.space.displacement(xi)
            views, offset = {}, 0
            for name, shape, dtype, numel in self.layout:
                views[name] = theta[offset : offset + numel].view(shape).to(dtype)
                offset += numel
            with _reparametrize_module(self.model, views, tie_weights=True):
                loss = self.loss_fn(self.model, self.batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError("The loss must be a scalar tensor (a mean over the batch).")
            value = float(loss.detach())
            if not math.isfinite(value):
                where = "the unperturbed weights" if not bool(xi.detach().any()) else f"a perturbed point (rho={self.rho})"
                hint = "check the inputs and labels" if "unperturbed" in where else "lower rho"
                raise FloatingPointError(f"The loss is {value} at {where}; {hint}.")
            grad = torch.autograd.grad(loss, xi)[0] if need_grad else None
        return value, grad


# ---------------------------------------------------------------------- runner
def _check_common(rho: float, mode: str, steps: int, n_samples: int) -> None:
    if not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho <= 0:
        raise ValueError(f"rho must be a positive finite number, got {rho!r}.")
    if mode not in ("worst", "average"):
        raise ValueError(f"mode must be 'worst' or 'average', got {mode!r}.")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}.")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}.")


def _movable_mask(params: list[Tensor], which: str, device: torch.device) -> Tensor | None:
    if which == "all":
        return None
    if which == "trainable":
        mask = torch.cat([torch.full((p.numel(),), p.requires_grad, dtype=torch.bool) for p in params]).to(device)
        if not mask.any():
            raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
        return mask
    raise ValueError(f"params must be 'all' or 'trainable', got {which!r}.")


def _batch_seed(seed: int, index: int) -> int:
    """A per-batch seed that does not depend on which process solves the batch."""
    return (seed * 1_000_003 + 7919 * (index + 1)) % (2**63 - 1)


def _run(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    measure: str,
    options: SpaceOptions | None,
    solve: Callable[[PerturbationSpace, _Objective, torch.Generator], SolveResult],
    loss_fn: LossFn | None,
    accelerator: Any,
    progress: bool,
    symmetry_map: SymmetryMap | None,
    config: dict[str, Any],
) -> SharpnessResult:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    batches = list(batches)
    if not batches:
        raise ValueError("No batches were given; pass a non-empty list of batches (dicts of model inputs with labels).")
    for i, batch in enumerate(batches):
        if isinstance(batch, Mapping) and (not batch or any(isinstance(v, Tensor) and v.numel() == 0 for v in batch.values())):
            raise ValueError(f"Batch {i} is empty; drop it or check the data pipeline.")
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    loss_fn = loss_fn or _default_loss

    with preserved_model_state(model):
        names, params, theta0 = _flat_parameters(model)
        device = theta0.device
        if options is not None and options.metric is not None and symmetry_map is None:
            from .symmetry import map_symmetries

            symmetry_map = map_symmetries(model)
        blocks = []
        if options is not None and options.metric is not None:
            if symmetry_map.param_names != names:
                raise ValueError(
                    "The symmetry map was built for another model (parameter names differ); rebuild it with "
                    "gs.map_symmetries(model)."
                )
            blocks = symmetry_map.blocks
        space = PerturbationSpace(
            theta0, blocks, options or SpaceOptions(metric=None), _movable_mask(params, config["params"], device), config["seed"]
        )
        logger.info("%s: %d GL pairs, %d parameters, %d batches", measure, space.n_pairs, theta0.numel(), len(batches))

        mine = list(range(rank, len(batches), world))
        results: dict[int, tuple[float, float]] = {}
        bar = tqdm(mine, desc=measure, unit="batch", disable=not progress or rank != 0)
        for index in bar:
            batch = _to_device(batches[index], device)
            objective = _Objective(model, names, params, space, batch, loss_fn, config["rho"])
            generator = torch.Generator().manual_seed(_batch_seed(config["seed"], index))
            out = solve(space, objective, generator)
            results[index] = (out.sharpness, out.clean_loss)
            bar.set_postfix(sharpness=f"{out.sharpness:.4g}")

    if world > 1:
        from accelerate.utils import gather_object

        merged: dict[int, tuple[float, float]] = {}
        for part in gather_object([results]):
            merged.update(part)
        results = merged
    per_batch = [results[i][0] for i in range(len(batches))]
    per_clean = [results[i][1] for i in range(len(batches))]
    config = {**config, "n_batches": len(batches), "n_processes": world, "library": f"hf_geosharp {__version__}"}
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        clean_loss=sum(per_clean) / len(per_clean),
        per_batch_clean_loss=per_clean,
        measure=measure,
        config=config,
    )


def geodesic_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = 0.1,
    metric: Literal["inv", "mix"] = "inv",
    mode: Mode = "worst",
    steps: int = 20,
    seed: int = 0,
    epsilon: float = 1e-6,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    symmetry_map: SymmetryMap | None = None,
    params: Literal["all", "trainable"] = "all",
    n_samples: int = 20,
    second_order: bool = True,
    riemannian_norm: bool = True,
    horizontal_projection: bool = True,
    elementwise_curvature: Curvature = "none",
    step_normalization: StepNormalization = "riemannian",
) -> SharpnessResult:
    """Geodesic sharpness (da Silva, Dangel & Oore, ICML 2025): sharpness on the quotient by the attention symmetries.

    Perturbations are horizontal (orthogonal to the GL(h) orbits of every QK and VO head pair), bounded in the
    Riemannian norm ``||xi||_g <= rho`` and applied along second-order geodesics; all other parameters are perturbed
    as in adaptive sharpness. The number is invariant under ``gs.reparametrize(model)`` (up to ``epsilon``).

    Args:
        model: any ``nn.Module``; restored exactly afterwards (weights, ``requires_grad``, ``.grad``, train/eval mode).
        batches: iterable of dicts accepted by ``model(**batch)`` with labels (loss = ``outputs.loss``), or anything
            ``loss_fn`` accepts. Each batch is solved separately and the values are averaged.
        rho: radius of the geodesic ball.
        metric: ``"inv"`` (paper Eq. 9) or ``"mix"`` (Eq. 10).
        mode: ``"worst"`` (Auto-PGD, ``steps`` iterations) or ``"average"`` (``n_samples`` Gaussian directions).
        steps: solver iterations per batch (worst case).
        seed: seeds the average-case samples (per batch, independent of the process that solves it).
        epsilon: relaxation ``G^T G + eps I`` for near-singular heads.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        accelerator: an ``accelerate.Accelerator``: batches are sharded over its processes and gathered, so every
            process returns the full result. Move the model to ``accelerator.device`` first; do not DDP-wrap it.
        progress: show a progress bar.
        symmetry_map: where the pairs are; default ``gs.map_symmetries(model)``.
        params: ``"all"`` (default, as in AS23) or ``"trainable"`` (e.g. only LoRA adapters).
        n_samples: directions per batch (average case).
        second_order, riemannian_norm, horizontal_projection: ablation switches (paper App. G).
        elementwise_curvature: geodesic for non-attention parameters (``"none"``: first order, as the paper).
        step_normalization: ``"riemannian"`` (invariant, default), ``"euclidean"`` or ``"none"``.
    """
    _check_common(rho, mode, steps, n_samples)
    if metric not in ("inv", "mix"):
        raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}.")
    if step_normalization not in ("riemannian", "euclidean", "none"):
        raise ValueError(f"step_normalization must be 'riemannian', 'euclidean' or 'none', got {step_normalization!r}.")
    options = SpaceOptions(metric, epsilon, second_order, riemannian_norm, horizontal_projection, elementwise_curvature)
    config = dict(
        rho=rho, metric=metric, mode=mode, steps=steps, seed=seed, epsilon=epsilon, params=params, n_samples=n_samples,
        second_order=second_order, riemannian_norm=riemannian_norm, horizontal_projection=horizontal_projection,
        elementwise_curvature=elementwise_curvature, step_normalization=step_normalization,
    )

    def solve(space, objective, generator):
        if mode == "average":
            return average_case(space, objective, rho=rho, n_samples=n_samples, generator=generator)
        return apgd(space, objective, rho=rho, steps=steps, step_normalization=step_normalization)

    return _run(
        model, batches, measure=f"geodesic_{metric}_{mode}", options=options, solve=solve, loss_fn=loss_fn,
        accelerator=accelerator, progress=progress, symmetry_map=symmetry_map, config=config,
    )


def adaptive_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = 0.1,
    mode: Mode = "worst",
    steps: int = 20,
    seed: int = 0,
    variant: Literal["as23", "clean"] = "as23",
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    params: Literal["all", "trainable"] = "all",
    n_samples: int = 20,
) -> SharpnessResult:
    """Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023): ``max_{||delta / |w| || <= rho} L(w + delta) - L(w)``.

    ``variant="as23"`` reproduces the reference code (``m_apgd_l2``, adaptive) quirks included, so numbers are
    comparable with the literature; ``"clean"`` runs the same solver as :func:`geodesic_sharpness` on the elementwise
    metric (one forward per step). Arguments as in :func:`geodesic_sharpness`.
    """
    _check_common(rho, mode, steps, n_samples)
    if variant not in ("as23", "clean"):
        raise ValueError(f"variant must be 'as23' or 'clean', got {variant!r}.")
    config = dict(rho=rho, mode=mode, steps=steps, seed=seed, variant=variant, params=params, n_samples=n_samples)

    def solve(space, objective, generator):
        if mode == "average":
            return average_case(space, objective, rho=rho, n_samples=n_samples, generator=generator)
        if variant == "as23":
            return apgd_as23(space.elementwise.scale, objective, rho=rho, steps=steps)
        return apgd(space, objective, rho=rho, steps=steps)

    measure = f"adaptive_{variant}_{mode}" if mode == "worst" else "adaptive_average"
    return _run(
        model, batches, measure=measure, options=None, solve=solve, loss_fn=loss_fn,
        accelerator=accelerator, progress=progress, symmetry_map=None, config=config,
    )
