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
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from tqdm.auto import tqdm

from . import __version__
from .geometry.elementwise import Curvature
from .solver import AUTO_MAX_STEPS, CONVERGENCE_TOL, SolveResult, StepNormalization, apgd, apgd_as23, average_case
from .space import PerturbationSpace, SpaceOptions
from .symmetry.base import SymmetryMap

logger = logging.getLogger(__name__)

Mode = Literal["worst", "average"]
Steps = int | Literal["auto"]
LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class SharpnessResult:
    """A sharpness measurement.

    Attributes:
        value: mean over batches of (max or mean perturbed loss) minus clean loss.
        per_batch: the value of each batch, in batch order.
        clean_loss: mean clean loss over batches.
        per_batch_clean_loss: the clean loss of each batch.
        measure: e.g. ``"geodesic_inv_worst"`` or ``"adaptive_clean_worst"``.
        config: every setting that determines the number (rho, steps, seed, epsilon, ...).
        stderr: standard error of ``value``: over batches for the worst case (NaN with one batch); over batches
            and samples for the average case and relative flatness (see :func:`average_stderr`).
        converged: whether every batch's best value gained at most ``config["tol"]`` (relative) over the last
            quarter of its steps (always True for the average case, which does not iterate).
        convergence_gain: the largest such relative gain over the batches (NaN for the average case).
        steps_used: the most solver steps any batch used (``steps="auto"`` may use more than its first block);
            ``None`` for measures that do not iterate.
    """

    value: float
    per_batch: list[float]
    clean_loss: float
    per_batch_clean_loss: list[float]
    measure: str
    config: dict[str, Any] = field(default_factory=dict)
    stderr: float = math.nan
    converged: bool = True
    convergence_gain: float = math.nan
    steps_used: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        error = "" if math.isnan(self.stderr) else f" +- {self.stderr:.2g}"
        flag = "" if self.converged else f", NOT converged (gain {self.convergence_gain:.2%} in the last quarter)"
        return (
            f"{self.measure}: {self.value:.6g}{error} (clean loss {self.clean_loss:.6g}, "
            f"{len(self.per_batch)} batches, rho={self.config.get('rho')}{flag})"
        )


def _sample_var(xs: list[float]) -> float:
    n = len(xs)
    mean = sum(xs) / n
    return sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan


def batch_stderr(per_batch: list[float]) -> float:
    """Standard error of the mean over batches (the batches are the random draw); NaN with one batch."""
    return math.sqrt(_sample_var(per_batch) / len(per_batch)) if len(per_batch) > 1 else math.nan


def average_stderr(samples: list[list[float]]) -> float:
    """Standard error of the mean of batch means for per-batch samples (``samples[b]``: one batch's draws).

    With two or more batches, the spread of the batch means (it contains the sampling noise of each mean as well
    as the spread between batches; the cluster estimator); with one batch, the spread of its samples over their
    number. NaN with one sample in all."""
    if len(samples) > 1:
        return batch_stderr([sum(s) / len(s) for s in samples])
    only = samples[0]
    return math.sqrt(_sample_var(only) / len(only)) if len(only) > 1 else math.nan


# ---------------------------------------------------------------------- model safety
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


def _flat_parameters(model: nn.Module) -> tuple[list[str], list[Tensor], Tensor]:
    """Names, tensors and their flat concatenation ``theta0`` (fp32 for half-precision weights, else their dtype).

    ``theta0`` is needed only while the perturbation space is built (it reads the pairs and the metric from it);
    afterwards the space reads the parameters themselves, so the caller drops it."""
    named = list(model.named_parameters())
    if not named:
        raise ValueError("The model has no parameters to perturb.")
    names, params = [n for n, _ in named], [p for _, p in named]
    for name, p in named:
        if p.is_meta:
            raise ValueError(
                f"Parameter {name!r} is on the meta device (no data). Load the weights first, e.g. "
                "`from_pretrained(...)` without `device_map='meta'`, or `model.to_empty(device=...)` and load a "
                "state dict."
            )
        if not p.is_floating_point():
            raise ValueError(f"Parameter {name!r} has dtype {p.dtype}; sharpness needs floating-point weights.")
    work_dtype = torch.promote_types(torch.float32, max((p.dtype for p in params), key=lambda d: torch.finfo(d).bits))
    theta0 = torch.cat([p.detach().reshape(-1).to(work_dtype) for p in params])
    if not torch.isfinite(theta0.sum()):  # one read pass: NaN and inf propagate; the search runs only then
        bad = (~torch.isfinite(theta0)).nonzero()
        if len(bad):  # (a finite vector can still overflow the sum)
            offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)
            first = int(torch.searchsorted(offsets, bad[0, 0].cpu(), right=True)) - 1
            raise ValueError(
                f"Parameter {names[first]!r} has NaN or inf entries; sharpness is undefined for such weights."
            )
    return names, params, theta0


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
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


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class _Objective:
    """``(xi, need_grad, out=None) -> (loss, dloss/dxi)`` at weights ``Exp(theta0; xi)`` on the current ``batch``.

    One objective serves a whole run, so its parameter-sized buffer is allocated once. The perturbed weights are
    written into that flat buffer (``space.exp_point``) and its per-parameter views are swapped into the model for
    one call (stateless reparametrisation): the user's parameters are never touched. For the backward pass the views
    are detached leaves, so backward yields per-parameter gradients, each copied into the flat ``out`` as soon as it
    is ready; differentiating through slices of a flat tensor instead would cost a parameter-sized zero fill per
    parameter. The derivative of the geodesic's curvature terms is then applied by the space's pullback.

    Args:
        grad_scope: ``"movable"`` computes gradients only for parameters that can move (enough for the clean solver,
            which multiplies the gradient by the metric); ``"all"`` for every parameter (AS23 and the Euclidean step
            normalisation divide by the global gradient norm, frozen and zero-weight coordinates included).
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        params: list[Tensor],
        space: PerturbationSpace,
        loss_fn: LossFn,
        rho: float,
        grad_scope: Literal["movable", "all"] = "movable",
    ) -> None:
        self.model, self.space, self.loss_fn, self.rho = model, space, loss_fn, rho
        self.batch: Any = None
        self.names, self.dtypes = names, [p.dtype for p in params]
        self.numels = [p.numel() for p in params]
        self.theta = space.empty()
        space.lend(self.theta)  # idle between model calls, when the solver asks the space for a direction
        self.views = [v.view(p.shape) for v, p in zip(self.theta.split(self.numels), params)]
        moves = space.segments_move(self.numels)
        self.differentiate = [grad_scope == "all" or m for m in moves]
        self.positions = [i for i, d in enumerate(self.differentiate) if d]
        self.graph_checked = False

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        pullback = self.space.exp_point(xi, self.theta, need_grad, idle=out)  # out: written only by backward
        tensors, leaves = {}, []
        for name, view, dtype, differentiate in zip(self.names, self.views, self.dtypes, self.differentiate):
            t = view if view.dtype == dtype else view.to(dtype)
            if need_grad and differentiate:
                t = t.detach().requires_grad_(True)
                leaves.append(t)
            tensors[name] = t
        # Backward runs inside the reparametrisation too: activation checkpointing recomputes the forward during
        # backward, and must see the perturbed weights, not the user's.
        with torch.set_grad_enabled(need_grad), _reparametrize_module(self.model, tensors, tie_weights=True):
            loss = self.loss_fn(self.model, self.batch)
            value = self._checked_value(loss, xi)
            if not need_grad:
                return value, None
            out = torch.empty_like(self.theta) if out is None else out
            self._backward(loss, leaves, out)
        if pullback is not None:
            pullback(out, idle=self.theta)  # the weights are not needed after the backward
        return value, out

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
        """``dloss/dtheta`` into ``out``, streamed parameter by parameter (zero where nothing is differentiated)."""
        if leaves and not loss.requires_grad:
            raise TypeError(
                "The loss does not depend on the model's parameters (it has no autograd graph); a loss_fn must "
                "compute it from `model(...)` outputs without detaching or using torch.no_grad()."
            )
        if not self.graph_checked:  # once per run: the graph's structure does not change between steps
            _refuse_reentrant_checkpointing(loss)
            self.graph_checked = True
        segments, filled = out.split(self.numels), set()

        def stream(position: int) -> Callable[[Tensor], None]:
            # Copy each gradient into the flat buffer as soon as backward has it, and drop it: the per-parameter
            # gradients are then never all alive at once (a plain backward keeps them all in .grad).
            def hook(leaf: Tensor) -> None:
                segments[position].copy_(leaf.grad.reshape(-1))
                leaf.grad = None
                filled.add(position)

            return hook

        for position, leaf in zip(self.positions, leaves):
            leaf.register_post_accumulate_grad_hook(stream(position))
        if leaves:
            torch.autograd.backward(loss, inputs=leaves)
        missing = [segment for i, segment in enumerate(segments) if i not in filled]
        if missing:
            torch._foreach_zero_(missing)


def _refuse_reentrant_checkpointing(loss: Tensor) -> None:
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


# ---------------------------------------------------------------------- runner
def _check_common(rho: float, mode: str, steps: Steps, n_samples: int, seed: int) -> tuple[float, Steps, int, int]:
    """Refuse bad settings; return them as plain Python numbers (numpy scalars are accepted, e.g. ``np.int64(20)``)."""

    def integral(value: Any) -> bool:  # bool is an int subclass: steps=True would silently mean 1 step
        return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))

    auto = isinstance(steps, str) and steps == "auto"
    if not isinstance(rho, numbers.Real) or isinstance(rho, (bool, np.bool_)) or not math.isfinite(rho) or rho <= 0:
        raise ValueError(f"rho must be a positive finite number, got {rho!r}.")
    if mode not in ("worst", "average"):
        raise ValueError(f"mode must be 'worst' or 'average', got {mode!r}.")
    if not auto and (not integral(steps) or steps < 1):
        raise ValueError(f"steps must be a positive integer or 'auto', got {steps!r}.")
    if not integral(n_samples) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}.")
    if not integral(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    return float(rho), steps if auto else int(steps), int(n_samples), int(seed)


_CLASSIFIER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForImageClassification")
_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


def _check_batch(model: nn.Module, batch: Any, i: int) -> None:
    """Refuse, before any work, the batches that would otherwise fail deep inside the model or the loss.

    Empty batches; rows that disagree in number (dimension 0; size 1 may broadcast); class labels outside the
    classifier's range, which cross-entropy reports as a bare index error on the CPU and as a device-side assert,
    that poisons the CUDA context, on a GPU."""
    if not isinstance(batch, Mapping):
        return
    tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
    if not batch or any(v.numel() == 0 for v in tensors.values()):
        raise ValueError(f"Batch {i} is empty; drop it or check the data pipeline.")
    rows = {k: v.shape[0] for k, v in tensors.items() if v.dim() > 0 and v.shape[0] != 1}
    if len(set(rows.values())) > 1:
        raise ValueError(f"Batch {i} is ragged: its tensors disagree on the number of examples (dimension 0): {rows}.")
    lengths = {k: tensors[k].shape[1] for k in _TOKEN_INPUTS if k in tensors and tensors[k].dim() > 1}
    if len(set(lengths.values())) > 1:  # some models broadcast a short mask silently
        raise ValueError(f"Batch {i} is ragged: its token inputs disagree on the sequence length: {lengths}.")
    inference = [k for k, v in tensors.items() if v.is_inference()]
    if inference:
        raise ValueError(
            f"Batch {i} holds tensors made inside torch.inference_mode() ({', '.join(inference)}), which autograd "
            "cannot use; build the batches outside it, or pass clones made outside it (t.clone())."
        )
    _check_tokens(model, tensors, i)
    labels, config = tensors.get("labels"), getattr(model, "config", None)
    n_labels = getattr(config, "num_labels", None)
    if (
        labels is not None and labels.is_floating_point() and labels.dim() == 1 and isinstance(n_labels, int)
        and n_labels >= 2 and getattr(config, "problem_type", None) is None
        and type(model).__name__.endswith(_CLASSIFIER_HEADS)
    ):
        raise ValueError(
            f"Batch {i} has float labels ({labels.dtype}) for a classifier with {n_labels} classes; pass class ids "
            "as integers (labels.long()), or for multi-label targets a float tensor of shape [batch, num_labels] "
            "with config.problem_type='multi_label_classification'."
        )
    if (
        labels is not None and not labels.is_floating_point() and n_labels == 1
        and type(model).__name__.endswith(_CLASSIFIER_HEADS) and getattr(config, "problem_type", None) is None
    ):
        raise ValueError(
            f"Batch {i} has integer labels for a model with one output (num_labels=1, a regression head); pass the "
            "targets as floats (labels.float()), or load the model with num_labels set to the number of classes."
        )
    if (
        labels is None or labels.is_floating_point() or not isinstance(n_labels, int) or n_labels < 2
        or getattr(config, "problem_type", None) in ("regression", "multi_label_classification")
        or not type(model).__name__.endswith(_CLASSIFIER_HEADS)
    ):
        return
    real = labels[labels != -100]  # -100: positions the loss ignores
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= n_labels):
        bad = int(real.max()) if int(real.max()) >= n_labels else int(real.min())
        raise ValueError(
            f"Batch {i} has label {bad}, but the model has {n_labels} classes (config.num_labels); labels must be in "
            f"0..{n_labels - 1} (or -100 to ignore a position)."
        )


def _embedding_rows(model: nn.Module, suffix: str) -> tuple[str, int] | None:
    """The first ``nn.Embedding`` whose name ends in ``suffix``, and how many rows (ids or positions) it can look up
    (RoBERTa-style position tables reserve ``padding_idx + 1`` rows)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.endswith(suffix):
            reserved = module.padding_idx + 1 if suffix == "position_embeddings" and module.padding_idx else 0
            return name, module.num_embeddings - reserved
    return None


def _check_tokens(model: nn.Module, tensors: Mapping[str, Tensor], i: int) -> None:
    """Token ids and sequence lengths the model's tables can look up: out of range they fail as a bare "index out of
    range in self" on the CPU and as a device-side assert (which poisons the CUDA context) on a GPU."""
    ids = tensors.get("input_ids")
    if ids is None or ids.is_floating_point() or ids.numel() == 0:
        return
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if isinstance(embedding, nn.Embedding):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= embedding.num_embeddings:
            bad = high if high >= embedding.num_embeddings else low
            raise ValueError(
                f"Batch {i} has token id {bad}, but the model's embedding has {embedding.num_embeddings} rows "
                f"(ids 0..{embedding.num_embeddings - 1}); encode the texts with the model's own tokenizer."
            )
    types = tensors.get("token_type_ids")
    table = _embedding_rows(model, "token_type_embeddings")
    if types is not None and table is not None and types.numel() and int(types.max()) >= table[1]:
        raise ValueError(f"Batch {i} has token_type_id {int(types.max())}, but the model knows {table[1]} types "
                         f"(config.type_vocab_size); use the model's own tokenizer.")
    positions = _embedding_rows(model, "position_embeddings")
    if positions is not None and ids.dim() > 1 and ids.shape[-1] > positions[1]:
        raise ValueError(
            f"Batch {i} has sequences of {ids.shape[-1]} tokens, but the model has {positions[1]} positions "
            f"(config.max_position_embeddings); truncate to at most {positions[1]} tokens (tokenizer(..., "
            f"truncation=True, max_length={positions[1]}), or --max-length {positions[1]} on the command line)."
        )


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
    solve: Callable[[PerturbationSpace, _Objective, torch.Generator, Callable[[int, float], None]], SolveResult],
    loss_fn: LossFn | None,
    accelerator: Any,
    progress: bool,
    symmetry_map: SymmetryMap | None,
    config: dict[str, Any],
    grad_scope: Literal["movable", "all"] = "movable",
) -> SharpnessResult:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(batches, (Mapping, Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            "batches must be an iterable of batches (e.g. a list of dicts of model inputs), "
            f"got {type(batches).__name__}."
        )
    batches = list(batches)
    if not batches:
        raise ValueError("No batches were given; pass a non-empty list of batches (dicts of model inputs with labels).")
    for i, batch in enumerate(batches):
        _check_batch(model, batch, i)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    loss_fn = loss_fn or _default_loss

    with preserved_model_state(model):
        names, params, theta0 = _flat_parameters(model)
        half = sorted({p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)}, key=str)
        if half:
            warnings.warn(
                f"The model computes in {', '.join(map(str, half))}. The perturbation is built in float32 but the "
                "weights are rounded to the model's dtype for each forward pass, so perturbations below its resolution "
                f"(relative {max(torch.finfo(d).eps for d in half):.0e} per weight) vanish and loss differences are "
                "quantised: small rho can give exactly 0. Cast the model to float32 (model.float()) to measure it.",
                UserWarning,
                stacklevel=3,
            )
        device = theta0.device
        if options is not None and options.metric is not None and symmetry_map is None:
            from .symmetry import map_symmetries

            symmetry_map = map_symmetries(model, params=config["params"])
        blocks = []
        if options is not None and options.metric is not None:
            if symmetry_map.param_names != names:
                raise ValueError(
                    "The symmetry map was built for another model (parameter names differ); rebuild it with "
                    "gs.map_symmetries(model)."
                )
            blocks = symmetry_map.blocks
        space = PerturbationSpace(
            theta0, blocks, options or SpaceOptions(metric=None), _movable_mask(params, config["params"], device),
            config["seed"], base=params,
        )
        del theta0  # the space reads the parameters themselves from now on
        logger.info("%s: %d GL pairs, %s parameters, %d batch%s", measure, space.n_pairs, f"{space.numel:,}",
                    len(batches), "" if len(batches) == 1 else "es")

        objective = _Objective(model, names, params, space, loss_fn, config["rho"], grad_scope)
        n_steps = config["n_samples"] if config["mode"] == "average" else config["steps"]
        mine = list(range(rank, len(batches), world))
        results: dict[int, tuple[float, float, list[float] | None, float, int]] = {}
        bar = tqdm(mine, desc=measure, unit="batch", disable=not progress or rank != 0)
        for index in bar:
            objective.batch = _to_device(batches[index], device)
            generator = torch.Generator().manual_seed(_batch_seed(config["seed"], index))
            torch.manual_seed(_batch_seed(config["seed"], index))  # the forked global RNG: random models repeat

            def on_step(k: int, sharpness: float) -> None:  # solver progress inside the batch bar
                bar.set_postfix(step=f"{k + 1}/{n_steps}", sharpness=f"{sharpness:.4g}", refresh=False)
                bar.refresh()

            try:
                out = solve(space, objective, generator, on_step)
            except Exception as err:
                if hasattr(err, "add_note"):  # Python >= 3.11: say where, keep the type and message
                    keys = ", ".join(map(str, batches[index])) if isinstance(batches[index], Mapping) else "-"
                    err.add_note(f"hf_geosharp: raised while measuring batch {index} (inputs: {keys}) for {measure}.")
                raise
            samples = [loss - out.clean_loss for loss in out.losses[1:]] if config["mode"] == "average" else None
            results[index] = (out.sharpness, out.clean_loss, samples, out.convergence_gain, out.steps_used)
            bar.set_postfix(sharpness=f"{out.sharpness:.4g}")

    if world > 1:
        from accelerate.utils import gather_object

        merged: dict[int, tuple[float, float, list[float] | None, float, int]] = {}
        for part in gather_object([results]):
            merged.update(part)
        results = merged
    ordered = [results[i] for i in range(len(batches))]
    per_batch, per_clean = [r[0] for r in ordered], [r[1] for r in ordered]
    config = {**config, "n_batches": len(batches), "n_processes": world, "library": f"hf_geosharp {__version__}"}
    if config["mode"] == "average":
        stderr, gain, converged, steps_used = average_stderr([r[2] for r in ordered]), math.nan, True, None
    else:
        gain = max(r[3] for r in ordered)
        stderr, converged, steps_used = batch_stderr(per_batch), gain <= config["tol"], max(r[4] for r in ordered)
        if not converged:
            _warn_not_converged(measure, config, gain, steps_used)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        clean_loss=sum(per_clean) / len(per_clean),
        per_batch_clean_loss=per_clean,
        measure=measure,
        config=config,
        stderr=stderr,
        converged=converged,
        convergence_gain=gain,
        steps_used=steps_used,
    )


class NotConvergedWarning(UserWarning):
    """A worst-case value was still rising when the solver stopped (``SharpnessResult.converged`` is False)."""


_collectors: list[list[str]] = []


@contextlib.contextmanager
def collected_convergence_notes() -> Iterator[list[str]]:
    """Collect the not-converged notes of every measurement inside the block instead of warning once per call.

    For faces that run many measurements (leaderboards, the demo): they report one summary line instead of a
    warning per model and measure; each result still carries ``converged`` and ``convergence_gain``."""
    notes: list[str] = []
    _collectors.append(notes)
    try:
        yield notes
    finally:
        _collectors.remove(notes)


def _warn_not_converged(measure: str, config: dict[str, Any], gain: float, steps_used: int) -> None:
    """Say that the worst case is still rising, and how to fix it (logger and :class:`NotConvergedWarning`)."""
    if config["steps"] == "auto":
        fix = f"raise the budget (max_steps, now {config['max_steps']}) or lower rho"
    else:
        fix = f"pass steps='auto' (or more steps, e.g. steps={max(200, 10 * steps_used)})"
    message = (
        f"{measure} at rho={config['rho']} is not converged: the best value still rose by {gain:.2%} over the last "
        f"quarter of its {steps_used} steps (tolerance {config['tol']:.2%}), so it underestimates the maximum; {fix}."
    )
    if _collectors:
        _collectors[-1].append(message)
        return
    logger.warning(message)
    warnings.warn(message, NotConvergedWarning, stacklevel=4)


def _solver_steps(steps: Steps, max_steps: int) -> tuple[int, int | None]:
    """``(first block, budget or None)``: ``steps="auto"`` starts with 20 steps and may continue up to ``max_steps``."""
    return (min(20, max_steps), max_steps) if steps == "auto" else (steps, None)


def _check_convergence_args(tol: float, max_steps: int) -> None:
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}.")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}.")


def geodesic_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = 0.1,
    metric: Literal["inv", "mix"] = "inv",
    mode: Mode = "worst",
    steps: Steps = 20,
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
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
) -> SharpnessResult:
    """Geodesic sharpness (da Silva, Dangel & Oore, ICML 2025): sharpness on the quotient by the attention symmetries.

    Perturbations are horizontal (orthogonal to the GL(h) orbits of every QK and VO head pair), bounded in the
    Riemannian norm ``||xi||_g <= rho`` and applied along second-order geodesics; all other parameters are perturbed
    as in adaptive sharpness. The number is invariant under ``gs.reparametrize(model)``, also with the default
    ``epsilon`` (the relaxation is built to transform with the group; docs/method.md).

    Args:
        model: any ``nn.Module``; restored exactly afterwards (weights, ``requires_grad``, ``.grad``, train/eval mode).
            It runs in eval mode; activation checkpointing that stays on there must be the non-reentrant kind.
        batches: iterable of dicts accepted by ``model(**batch)`` with labels (loss = ``outputs.loss``), or anything
            ``loss_fn`` accepts. Each batch is solved separately and the values are averaged.
        rho: radius of the geodesic ball.
        metric: ``"inv"`` (paper Eq. 9) or ``"mix"`` (Eq. 10).
        mode: ``"worst"`` (Auto-PGD, ``steps`` iterations) or ``"average"`` (``n_samples`` Gaussian directions).
        steps: solver iterations per batch (worst case), or ``"auto"``: 20, then more in blocks while the best value
            still gains more than ``tol`` over the last quarter of the steps, up to ``max_steps``.
        seed: seeds the average-case samples (per batch, independent of the process that solves it).
        epsilon: relative, group-covariant rank relaxation of ``G^T G`` and ``H^T H`` (about ``epsilon`` relative
            to each head's own spectrum); 0 for the exact metric (then rank-deficient heads are refused).
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
        tol: relative gain over the last quarter of the steps under which a worst case counts as converged; a
            ``UserWarning`` says when it is not (``res.converged``, ``res.convergence_gain``).
        max_steps: step budget of ``steps="auto"``.
    """
    rho, steps, n_samples, seed = _check_common(rho, mode, steps, n_samples, seed)
    _check_convergence_args(tol, max_steps)
    if metric not in ("inv", "mix"):
        raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}.")
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}.")
    epsilon = float(epsilon)
    if step_normalization not in ("riemannian", "euclidean", "none"):
        raise ValueError(f"step_normalization must be 'riemannian', 'euclidean' or 'none', got {step_normalization!r}.")
    options = SpaceOptions(metric, epsilon, second_order, riemannian_norm, horizontal_projection, elementwise_curvature)
    config = dict(
        rho=rho, metric=metric, mode=mode, steps=steps, seed=seed, epsilon=epsilon, params=params, n_samples=n_samples,
        second_order=second_order, riemannian_norm=riemannian_norm, horizontal_projection=horizontal_projection,
        elementwise_curvature=elementwise_curvature, step_normalization=step_normalization, tol=tol,
        max_steps=max_steps,
    )
    first, budget = _solver_steps(steps, max_steps)

    def solve(space, objective, generator, on_step):
        if mode == "average":
            return average_case(space, objective, rho=rho, n_samples=n_samples, generator=generator, on_step=on_step)
        return apgd(space, objective, rho=rho, steps=first, step_normalization=step_normalization, on_step=on_step,
                    max_steps=budget, tol=tol)

    return _run(
        model, batches, measure=f"geodesic_{metric}_{mode}", options=options, solve=solve, loss_fn=loss_fn,
        accelerator=accelerator, progress=progress, symmetry_map=symmetry_map, config=config,
        grad_scope="all" if step_normalization == "euclidean" else "movable",
    )


def adaptive_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = 0.1,
    mode: Mode = "worst",
    steps: Steps = 20,
    seed: int = 0,
    variant: Literal["clean", "as23"] = "clean",
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    params: Literal["all", "trainable"] = "all",
    n_samples: int = 20,
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
) -> SharpnessResult:
    """Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023):
    ``max_{||delta / |w| || <= rho} L(w + delta) - L(w)``.

    ``variant="clean"`` (default) runs the same solver as :func:`geodesic_sharpness` on the elementwise metric (one
    forward per step) and reaches the maximum of the definition. ``"as23"`` reproduces the reference code
    (``m_apgd_l2``, adaptive) quirks included, for comparison with published numbers; its fixed points are not the
    maximiser's, so it can stall several percent below the maximum (docs/method.md). Arguments as in
    :func:`geodesic_sharpness`.
    """
    rho, steps, n_samples, seed = _check_common(rho, mode, steps, n_samples, seed)
    _check_convergence_args(tol, max_steps)
    if variant not in ("as23", "clean"):
        raise ValueError(f"variant must be 'clean' or 'as23', got {variant!r}.")
    config = dict(rho=rho, mode=mode, steps=steps, seed=seed, variant=variant, params=params, n_samples=n_samples,
                  tol=tol, max_steps=max_steps)
    first, budget = _solver_steps(steps, max_steps)

    def solve(space, objective, generator, on_step):
        if mode == "average":
            return average_case(space, objective, rho=rho, n_samples=n_samples, generator=generator, on_step=on_step)
        if variant == "as23":
            return apgd_as23(space.elementwise.scale, objective, rho=rho, steps=first, on_step=on_step,
                             max_steps=budget, tol=tol)
        return apgd(space, objective, rho=rho, steps=first, on_step=on_step, max_steps=budget, tol=tol)

    measure = f"adaptive_{variant}_{mode}" if mode == "worst" else "adaptive_average"
    return _run(
        model, batches, measure=measure, options=None, solve=solve, loss_fn=loss_fn,
        accelerator=accelerator, progress=progress, symmetry_map=None, config=config,
        grad_scope="all" if variant == "as23" else "movable",
    )
