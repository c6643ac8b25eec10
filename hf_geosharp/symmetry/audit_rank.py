"""The audits' numerical rank and verdict: a gap counts only where the spectrum is clear of float64 rounding.

A singular value of a float64 Jacobian sketch is told from zero against numpy's ``matrix_rank`` tolerance
``tol = sigma_max * max(m, n) * eps`` (``eps = 2.2e-16``). Round-off puts the null directions at a few ``eps``
relative, far below ``tol``; a real direction sits far above it. Between ``tol / DOUBT`` and ``tol * DOUBT`` a
singular value cannot be told from rounding, so a disagreement between the measured and the predicted rank that lies
only there is no evidence against the map. This holds only if the computation is float64 throughout: Hugging Face's
eager attention of most decoders and of ViT runs its softmax in float32 even in a float64 model, which leaves the key
and value bias directions at float32 round-off (~1e-9 relative), neither zero nor real. :func:`lower_precision_ops`
finds such operations before the audit, and :func:`use_float64_attention` picks an attention that avoids them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

EPS64 = torch.finfo(torch.float64).eps
DOUBT = 100.0  # two decades either side of the tolerance: a singular value there is not told from rounding


def rank_tolerance(sv: torch.Tensor, shape: tuple[int, ...]) -> float:
    """numpy's ``matrix_rank`` tolerance: the largest singular value times ``max(shape)`` times float64's eps.

    Args:
        sv: singular values, largest first.
        shape: the shape of the matrix they belong to.

    Returns:
        The absolute tolerance (0.0 for an empty or zero matrix).
    """
    return float(sv[0]) * max(shape) * EPS64 if sv.numel() else 0.0


def numerical_rank(sv: torch.Tensor, rtol: float | None = None, shape: tuple[int, ...] | None = None) -> int:
    """The number of singular values above the tolerance: ``rtol`` times the largest, or numpy's for ``shape``.

    Args:
        sv: singular values, largest first.
        rtol: a relative tolerance; ``None`` for :func:`rank_tolerance` (then ``shape`` is required).
        shape: the matrix's shape, for numpy's tolerance.

    Returns:
        The numerical rank.
    """
    if not sv.numel() or sv[0] <= 0:
        return 0
    if rtol is None:
        if shape is None:
            raise ValueError("numerical_rank needs the matrix's shape for numpy's tolerance, or an rtol")
        return int((sv > rank_tolerance(sv, shape)).sum())
    return int((sv > rtol * sv[0]).sum())


@dataclass
class RankVerdict:
    """The measured rank against the predicted one: ``gap`` counts the disagreements clear of rounding only."""

    rank: int
    tolerance: float
    gap: int
    gap_within_rounding: int
    verdict: str


def judge(sv: torch.Tensor, predicted: int, tolerance: float) -> RankVerdict:
    """Compare the numerical rank with ``predicted``, counting only singular values clear of rounding as evidence.

    The disputed singular values are those between the predicted and the measured rank. One counts towards the gap
    if it is above ``tolerance * DOUBT`` (a real direction the map calls null: the map claims too much symmetry) or
    at most ``tolerance / DOUBT`` (a null direction the prediction calls real: a redundancy it does not name); the
    others are within rounding. ``FAIL`` iff some disputed value is clear of rounding.

    Args:
        sv: singular values of the Jacobian sketch, largest first.
        predicted: the rank the symmetry map predicts.
        tolerance: the absolute rank tolerance (:func:`rank_tolerance`).

    Returns:
        The :class:`RankVerdict`.
    """
    rank = int((sv > tolerance).sum()) if sv.numel() and sv[0] > 0 else 0
    reachable = max(0, min(predicted, sv.numel()))  # a prediction outside [0, n] is wrong by the excess
    lo, hi = sorted((rank, reachable))
    disputed = sv[lo:hi]
    clear = int(((disputed > tolerance * DOUBT) | (disputed <= tolerance / DOUBT)).sum())
    gap = (clear if reachable > rank else -clear) + (predicted - reachable)
    within = predicted - rank - gap
    return RankVerdict(rank, tolerance, gap, within, "PASS" if gap == 0 else "FAIL")


class _PrecisionProbe(TorchFunctionMode):
    """Records the operations whose output depends on the parameters and is a float below float64."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
                    and torch.finfo(t.dtype).eps > EPS64):
                self.found.add(f"{getattr(func, '__name__', func)} in {t.dtype}".replace("torch.", ""))
        return out


def lower_precision_ops(module: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The operations of ``module(*args, **kwargs)`` that compute a function of its parameters below float64.

    The parameters are replaced by copies that require grad (the module is not touched), so constants such as
    rotary tables computed in float32 from buffers are not reported, only what the Jacobian passes through.

    Args:
        module: a float64 module.
        args, kwargs: one call's arguments.

    Returns:
        Sorted ``"op in dtype"`` strings; empty when the computation is float64 throughout.
    """
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    probe = _PrecisionProbe()
    with torch.enable_grad(), probe:
        functional_call(module, params, args=args, kwargs=dict(kwargs or {}))
    return sorted(probe.found)


def use_float64_attention(model: nn.Module, batch: Mapping[str, Any]) -> str:
    """Set a model the caller owns (already float64) to an attention that computes in float64; its name.

    ``eager`` (plain matmul and softmax, vmap-friendly) when its softmax stays in float64 (BERT, GPT-2), else
    ``sdpa`` (PyTorch's fused attention, float64 on float64 inputs), since many eager attentions run the softmax in
    float32. This changes the model's attention setting: never call it on a user's model.

    Args:
        model: a float64 ``transformers`` model that the caller loaded itself.
        batch: one small input for ``model(**batch)``.

    Returns:
        The attention implementation now set.
    """
    model.set_attn_implementation("eager")
    if not any(op.startswith("softmax") for op in lower_precision_ops(model, kwargs=batch)):
        return "eager"
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):  # no sdpa for this architecture: the audit's probe names the problem
        return "eager"
    return "sdpa"
