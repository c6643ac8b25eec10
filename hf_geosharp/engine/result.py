"""What a measurement returns: :class:`SharpnessResult`, its error bars, the convergence warning, and the one rule for
showing a value with its certificate (:func:`certified`, :func:`shown`, :func:`certificate_words`)."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class BlockShare:
    """One block of a :class:`Breakdown`: a transformer layer, a group of parameters outside the layers, or one
    attention pair (a head, or a KV group of heads).

    Attributes:
        name: the layer's module path (``"bert.encoder.layer.3"``), or the module path of parameters outside the
            layers (``"bert.embeddings"``, ``"classifier"``), or a pair's label (``"... head 3"``).
        layer: the layer's position among the model's layers (0, 1, ...), or None outside the layers.
        head: a pair's head (or KV group) within its attention module; None for a layer or a parameter group.
        kind: a pair's kind (``"qk"``, ``"vo"``, ``"lora"``, ...); None for a layer or a parameter group.
        norm_sq: the block's part of ``||xi||_g^2`` (mean over batches).
        first_order: the block's part of ``<grad L(w), xi>_g`` (mean over batches).
        norm_share: ``norm_sq`` over the total: the blocks of one list sum to 1 (``Breakdown.heads`` together with
            the parameters outside the pairs, ``Breakdown.outside_pairs``).
        first_order_share: ``first_order`` over the total, likewise (negative where a block's part points downhill;
            NaN when the total is 0).
    """

    name: str
    layer: int | None
    head: int | None
    kind: str | None
    norm_sq: float
    first_order: float
    norm_share: float
    first_order_share: float


@dataclass
class Breakdown:
    """Where the worst-case perturbation ``xi`` (the best point of each batch) sits: its squared norm in the
    measure's own metric and the first-order term of the loss increase, ``<grad L(w), xi>_g``, per block. The
    metric is block-diagonal over heads and parameters, so the blocks' parts sum to the totals (docs/where.md).

    Attributes:
        layers: per layer (and per group of parameters outside the layers), in parameter order; pairs included.
        heads: per attention pair, in parameter order (empty for adaptive sharpness).
        outside_pairs: the parameters outside the pairs, as one block (its shares plus the heads' sum to 1).
        norm_sq: ``||xi||_g^2`` (mean over batches; ``rho^2`` where the best point is on the sphere).
        first_order: ``<grad L(w), xi>_g`` (mean over batches).
    """

    layers: list[BlockShare]
    heads: list[BlockShare]
    outside_pairs: BlockShare
    norm_sq: float
    first_order: float

    def layer_table(self) -> list[tuple[str, float, float]]:
        """``(name, norm share, first-order share)`` per layer, in order."""
        return [(b.name, b.norm_share, b.first_order_share) for b in self.layers]

    def top_heads(self, n: int = 5) -> list[BlockShare]:
        """The ``n`` pairs with the largest norm share."""
        return sorted(self.heads, key=lambda b: -b.norm_share)[:n]


@dataclass
class Profile:
    """The loss along the worst direction of each batch: ``t`` runs over ``[0, 2]`` in units of the best point
    ``xi`` (``t = 1`` is the worst case itself, at radius ``rho``).

    Attributes:
        t: the points, fractions of the best point.
        geodesic: per batch, ``L(Exp(w; t xi)) - L(w)`` at each ``t`` (the measure's own curve; at ``t = 1`` the
            batch's value).
        segment: per batch, ``L(w + t (Exp(w; xi) - w)) - L(w)``: the straight Euclidean segment through the same
            end point (the same curve as ``geodesic`` for a first-order measure such as adaptive sharpness).
    """

    t: list[float]
    geodesic: list[list[float]]
    segment: list[list[float]]

    @staticmethod
    def mean(curves: list[list[float]]) -> list[float]:
        """The mean over batches of per-batch curves."""
        return [sum(c[j] for c in curves) / len(curves) for j in range(len(curves[0]))]


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
        stderr: standard error of ``value``: over batches for the worst case and exact relative flatness (NaN
            with one batch); over batches and samples for the average case and sampled relative flatness (see
            :func:`average_stderr`).
        converged: the certificate of the worst case (docs/method.md, "Convergence"): every batch's best point is
            stationary on the ball (its relative Frank-Wolfe gap is at most ``config["tol"]``) and, under
            ``steps="auto"``, a second start reached the same value within ``tol``: two starts agree on a
            stationary point, a local maximum, not necessarily the global one. Also True when that holds only at
            the resolution of the loss's floating type (``certificate == "certified_at_precision"``). Always True
            for measures that do not iterate (the average case, relative flatness).
        stationarity_gap: the largest relative Frank-Wolfe gap over the batches (NaN where nothing iterates): 0 at
            a stationary point, and where the loss is concave on the ball a bound on the relative distance to the
            maximum.
        convergence_note: why the result is not certified (the first such batch); when it is certified at
            precision, what was certified; None when certified within ``tol``.
        steps_used: the most points any batch evaluated after the clean one (solver steps and further starts);
            ``None`` for measures that do not iterate.
        breakdown: where the worst-case perturbation sits, by layer and by head (:class:`Breakdown`); None for the
            average case, relative flatness and sharded runs.
        profile: the loss along each batch's worst direction (:class:`Profile`) when asked for
            (``profile_points``), else None.
        perturbations: each batch's worst-case perturbation when asked for (``return_perturbation=True``): a
            :class:`~hf_geosharp.engine.worst_direction.WorstCasePerturbation` per batch (a state-dict-shaped delta
            and a context manager that applies it); else None. Not part of :meth:`to_dict`.
        certificate: ``"certified"`` (within ``tol``), ``"certified_at_precision"`` (stationary and agreeing only
            within the loss's resolution in its floating type, ``PRECISION_FACTOR * eps * |loss|``; the note says
            how much that is), ``"not_certified"`` (``converged`` is False; a lower bound), or ``"not_iterative"``.
        per_batch_solve: each batch's worst-case solve, in batch order: ``{"steps": points evaluated after the clean
            one, "certificate": its state, "starts": [{"kind", "value", "gap"} of each start]}`` (the starts' kinds
            as ``steps="auto"`` makes them: ``"zero"``, ``"antipode"``, ``"near"``, ``"random"``); None for measures
            that do not iterate and the average case.
    """

    value: float
    per_batch: list[float]
    clean_loss: float
    per_batch_clean_loss: list[float]
    measure: str
    config: dict[str, Any] = field(default_factory=dict)
    stderr: float = math.nan
    converged: bool = True
    stationarity_gap: float = math.nan
    convergence_note: str | None = None
    steps_used: int | None = None
    breakdown: Breakdown | None = None
    profile: Profile | None = None
    perturbations: list[Any] | None = field(default=None, repr=False, compare=False)
    certificate: str = "not_iterative"
    per_batch_solve: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result as plain data.

        Returns:
            Every field by name (JSON-ready apart from NaN), without the perturbations (parameter-sized).
        """
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "perturbations"}

    def __str__(self) -> str:
        flag = "" if self.converged else f", NOT converged: {self.convergence_note}"
        if self.certificate == "certified_at_precision":
            flag = f", {self.convergence_note}"
        return (
            f"{self.measure}: {shown(self.value, certified(self), digits=6, stderr=self.stderr)} "
            f"(clean loss {self.clean_loss:.6g}, "
            f"{len(self.per_batch)} batches, rho={self.config.get('rho')}{flag})"
        )


def _plain(value: Any) -> Any:
    return asdict(value) if hasattr(value, "__dataclass_fields__") else copy.deepcopy(value)


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


class NotConvergedWarning(UserWarning):
    """A worst-case value was still rising when the solver stopped (``SharpnessResult.converged`` is False)."""


#: ``SharpnessResult.certificate`` of a measure that does not iterate.
NOT_ITERATIVE = "not_iterative"

_collectors: list[list[str]] = []


@contextlib.contextmanager
def collected_convergence_notes() -> Iterator[list[str]]:
    """Collect the not-converged notes of every measurement inside the block instead of warning once per call.

    For faces that run many measurements (leaderboards, the demo): they report one summary line instead of a
    warning per model and measure; each result still carries ``converged`` and ``convergence_note``."""
    notes: list[str] = []
    _collectors.append(notes)
    try:
        yield notes
    finally:
        _collectors.remove(notes)


#: The top-level packages a measurement passes through on its way from the user's line: a warning is attributed to
#: the first frame outside them (``evaluate_modules``: the scripts evaluate loads from its module cache).
LIBRARIES = frozenset({"hf_geosharp", "evaluate", "evaluate_modules", "transformers", "accelerate", "torch", "tqdm",
                       "contextlib", "functools", "threading"})


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the caller's line: the first frame outside :data:`LIBRARIES`, whatever the
    path through the package (the API, the measures' bundle, evaluate, the Trainer callback, the command line).

    Args:
        message: the warning's text.
        category: its class.
    """
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in LIBRARIES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else level - 1)


#: ``None`` in Python; on the command line, the options of the command that runs (empty: not known).
_command_line: ContextVar[frozenset[str] | None] = ContextVar("hf_geosharp_command_line", default=None)


@contextlib.contextmanager
def command_line_words(options: Iterable[str] = ()) -> Iterator[None]:
    """Inside the block, advice names the command line's options (``--steps auto``) instead of Python's arguments
    (``steps='auto'``): the ``geosharp`` commands run inside it.

    Args:
        options: the option strings the running command declares (``--steps``, ...); advice for a setting the
            command has no option for names the Python argument instead. Empty: every setting has its option.
    """
    token = _command_line.set(frozenset(options))
    try:
        yield
    finally:
        _command_line.reset(token)


def on_command_line() -> bool:
    """Whether advice is read on the command line (inside :func:`command_line_words`)."""
    return _command_line.get() is not None


def has_option(flag: str) -> bool:
    """Whether advice may name ``flag``: on the command line, and the running command declares it.

    Args:
        flag: an option string (``--dtype``).

    Returns:
        ``True`` inside :func:`command_line_words` when the command has ``flag`` (or its options are not known).
    """
    options = _command_line.get()
    return options is not None and (not options or flag in options)


def setting(name: str, value: Any = None) -> str:
    """How advice names a setting: ``steps='auto'`` (Python) or ``--steps auto`` (inside :func:`command_line_words`,
    where the command has that option; else the Python argument, said to be one).

    Args:
        name: the Python argument's name (``max_steps``); the option is ``--`` and its dashed form.
        value: the value to pass, or ``None`` for the setting alone.

    Returns:
        The words for the reader's interface.
    """
    python = name if value is None else f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    if has_option(flag):
        return flag if value is None else f"{flag} {value}"
    return f"{python} (from Python)" if on_command_line() else python


def warn_not_converged(measure: str, config: dict[str, Any], note: str, steps_used: int) -> None:
    """Say that the worst case is not certified, why, and how to fix it: one :class:`NotConvergedWarning` (the CLI
    shows it as a log line), or a note for :func:`collected_convergence_notes`."""
    if config.get("variant") == "as23":
        fix = ("AS23's reproduced solver stops where its Euclidean projection undoes the step, which is not the "
               "maximum (docs/method.md); variant='clean' reaches it")
    elif "below the resolution" in note:  # more steps cannot resolve it
        fix = (f"raise {setting('rho')} until the value is well above the loss's resolution, or measure the model "
               "in a wider dtype")
    elif config["steps"] != "auto":
        fix = (f"pass {setting('steps', 'auto')} (it continues until the best point is stationary and a second start "
               "agrees)")
    elif "different maxima" in note:
        fix = (f"the landscape has several maxima at this rho: lower {setting('rho')}, or read the value as a lower "
               "bound")
    elif on_command_line():  # the command line keeps the default budget of steps='auto'
        fix = (f"lower {setting('rho')}, or raise the budget from Python (max_steps=, now {config['max_steps']}), "
               "or read the value as a lower bound")
    else:
        fix = f"raise the budget (max_steps, now {config['max_steps']}) or lower rho"
    message = (f"{measure} at rho={config['rho']} is not converged after {steps_used} steps, so it may underestimate "
               f"the maximum: {note}; {fix}.")
    if _collectors:
        _collectors[-1].append(message)
        return
    warn_at_caller(message, NotConvergedWarning)


# ------------------------------------------------------------------------------------------------ the display rule
#: How every face shows a worst-case value that is not certified: the largest value the solver found, a lower bound.
NOT_CERTIFIED = "not certified"
LOWER_BOUND = "a lower bound of the maximum"


def certified(result: SharpnessResult | Mapping[str, Any]) -> bool | None:
    """Whether ``result``'s value carries the certificate: ``converged`` for a worst case (a maximum) and for the
    Hessian's top eigenvalue (Lanczos, whose Ritz value is a lower bound of the largest eigenvalue),
    ``None`` for a measure that maximises nothing and so has no certificate to give: the average case (a sample mean
    with its ``stderr``), relative flatness (an exact trace) and the Hessian's trace. ``result`` is a
    :class:`SharpnessResult` or its ``to_dict()``; a worst case that records no ``converged`` (an older file) counts
    as not certified."""
    get = result.get if isinstance(result, Mapping) else lambda name: getattr(result, name, None)
    mode = (get("config") or {}).get("mode") or str(get("measure") or "").rsplit("_", 1)[-1]
    iterates = get("certificate") not in (None, NOT_ITERATIVE)  # e.g. the Hessian's Lanczos
    return bool(get("converged")) if mode == "worst" or iterates else None


def shown(value: float, certified: bool | None, digits: int = 4, stderr: float | None = None,
          compact: bool = False) -> str:
    """A value with its certificate, as every face prints it: ``"0.1234"`` when certified or without a certificate,
    ``"≥ 0.1234 (not certified)"`` when a worst case is not certified (its value is a lower bound of the maximum).
    A finite ``stderr`` is shown after the value with 2 significant digits (``"≥ 0.1234 ± 0.0021 (not certified)"``);
    ``compact`` drops the words (``"≥ 0.1234"``) for table cells whose table explains the sign."""
    text = f"{value:.{digits}g}" + (f" ± {stderr:.2g}" if stderr is not None and math.isfinite(stderr) else "")
    if certified is not False:
        return text
    return f"≥ {text}" if compact else f"≥ {text} ({NOT_CERTIFIED})"


def certificate_words(certified: bool | None) -> str:
    """The certificate in a table cell, a note or a name: ``"certified"``, ``"not certified (a lower bound of the
    maximum)"``, or ``"no certificate (not a worst case)"``."""
    if certified is None:
        return "no certificate (not a worst case)"
    return "certified" if certified else f"{NOT_CERTIFIED} ({LOWER_BOUND})"
