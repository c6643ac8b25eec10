"""Models in bfloat16 and float16: the model computes in its dtype, the solver's vectors and certificate in float32.

A half model is measured at its weights plus the float32 perturbation rounded to the model's dtype for each forward;
the loss is read in float32; the certificate judges loss differences against the loss's resolution in the model's
dtype, ``r = PRECISION_FACTOR * eps(dtype) * |L|`` (bfloat16: ``eps = 2^-7``, so ``r`` is 6 % of the loss). On the
small BERT below, the bfloat16 loss at 40 perturbed points differed from the float64 loss of the same weights by at
most ``1.5 eps |L|`` (median 0.4), float16 by at most 1.0: the float32 calibration of ``PRECISION_FACTOR`` holds, and
two half losses (a value is a difference of two) differ from exact by at most ``3 eps |L| < r``. Every comparison
here is therefore at ``r``: that is what bfloat16 resolves, and the adaptive control shows ``r`` is tight enough to
fail.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.engine.solvers.certificate import (
    AT_PRECISION,
    CERTIFIED,
    NOT_CERTIFIED,
    SolveResult,
    loss_resolution,
)

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import assert_intact, snapshot
from .test_bert_invariance import _batches, _bert

# rho / sqrt(n) = 0.3 / sqrt(18403) = 2.2e-3 is above bfloat16's eps / 4 = 2e-3: a typical weight moves past rounding
RHO = 0.3
FAST = dict(rho=RHO, steps=5, seed=0, progress=False)


@pytest.fixture(scope="module")
def pair():
    """A float64 BERT and a copy moved by a GL(h) element of condition 10 on every head pair (the same function)."""
    model = _bert().eval()
    moved = copy.deepcopy(model)
    gs.reparametrize(moved, condition=10.0)
    return model, moved


def _resolution(dtype: torch.dtype, *results: gs.SharpnessResult) -> float:
    losses = [x for r in results for x in (r.clean_loss, r.clean_loss + r.value)]
    return loss_resolution(str(dtype).removeprefix("torch."), *losses)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        return fn(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_model_is_left_as_it_was(pair, dtype):
    model = copy.deepcopy(pair[0]).to(dtype).train()
    model.classifier.weight.requires_grad_(False)
    model.bert.pooler.dense.weight.grad = torch.ones_like(model.bert.pooler.dense.weight)
    snap = snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = gs.geodesic_sharpness(model, _batches(), metric="inv", epsilon=0.0, **FAST)
    assert_intact(model, snap)
    assert math.isfinite(res.value) and res.value > 0
    assert not [w for w in caught if "rounds back" in str(w.message)]  # rho is above the rounding here


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_sharpness_of_a_bf16_model_is_invariant_at_its_resolution(pair, metric):
    """The two bfloat16 models round differently moved weights, so they are the same function only to bfloat16's
    rounding (their clean losses differ by a unit in the last place); the values agree within ``r``, while adaptive
    sharpness moves by more than ``r``."""
    half = [copy.deepcopy(m).to(torch.bfloat16) for m in pair]
    geodesic = [_quiet(gs.geodesic_sharpness, m, _batches(), metric=metric, epsilon=0.0, **FAST) for m in half]
    adaptive = [_quiet(gs.adaptive_sharpness, m, _batches(), **FAST) for m in half]
    r = _resolution(torch.bfloat16, *geodesic)
    assert geodesic[0].value > r  # a value bfloat16 resolves
    assert abs(geodesic[1].value - geodesic[0].value) <= r, ([g.value for g in geodesic], r)
    assert abs(adaptive[1].value - adaptive[0].value) > _resolution(torch.bfloat16, *adaptive), adaptive


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("metric", ["inv", None])
def test_a_half_value_is_the_float32_value_of_the_same_weights_at_the_resolution(pair, dtype, metric):
    """The same weights (the half model's, exactly representable in float32), measured in float32 and in the half
    dtype: within ``r`` of the half dtype (the half forward's rounding, and the perturbation rounding removes)."""
    half = copy.deepcopy(pair[0]).to(dtype)
    full = copy.deepcopy(half).float()
    if metric is None:
        values = [_quiet(gs.adaptive_sharpness, m, _batches(), **FAST) for m in (half, full)]
    else:
        values = [_quiet(gs.geodesic_sharpness, m, _batches(), metric=metric, epsilon=0.0, **FAST)
                  for m in (half, full)]
    r = _resolution(dtype, *values)
    assert abs(values[0].value - values[1].value) <= r, ([v.value for v in values], r)
    assert abs(values[0].clean_loss - values[1].clean_loss) <= r / 2
    assert values[1].value > r  # not two numbers both lost in the rounding


def test_a_bf16_value_is_certified_at_its_resolution_and_never_below_it(pair):
    """With ``steps="auto"``, bfloat16 certifies at precision (the note names bfloat16 and its ``r``); at a radius
    whose every point rounds back to the weights, the value is not certified, and a warning said so before the
    solve."""
    model = copy.deepcopy(pair[0]).to(torch.bfloat16)
    res = _quiet(gs.geodesic_sharpness, model, _batches(), metric="inv", epsilon=0.0, rho=RHO, steps="auto",
                 max_steps=60, seed=0, progress=False)
    assert res.converged and res.certificate == "certified_at_precision"
    assert "bfloat16" in res.convergence_note
    with pytest.warns(UserWarning, match="whole ball rounds back") as caught:
        tiny = _quiet(gs.geodesic_sharpness, model, _batches(), metric="inv", epsilon=0.0, rho=1e-3, steps=5,
                      seed=0, progress=False)
    assert "model.float()" in str(next(w.message for w in caught if "rounds back" in str(w.message)))
    assert not tiny.converged and tiny.certificate == "not_certified"
    assert "below the resolution of the loss in bfloat16" in tiny.convergence_note
    assert abs(tiny.value) <= _resolution(torch.bfloat16, tiny)


def test_a_typical_weight_below_rounding_is_warned_of_with_the_radius_that_resolves_it(pair):
    model = copy.deepcopy(pair[0]).to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"rho / sqrt\(n\)") as caught:
        # the average case holds every weight (the clean worst case holds an embedding's used rows only)
        gs.adaptive_sharpness(model, _batches(), rho=0.05, mode="average", n_samples=1, seed=0, progress=False)
    (message,) = [str(w.message) for w in caught if "rounds back" in str(w.message)]
    n = sum(p.numel() for p in model.parameters() if bool((p != 0).any()))
    assert f"{n:,} perturbed weights" in message
    assert f"at least {torch.finfo(torch.bfloat16).eps / 4 * math.sqrt(n):.2g}" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        gs.adaptive_sharpness(model.float(), _batches(), rho=0.05, mode="average", n_samples=1, seed=0,
                              progress=False)  # float32: silent


def test_a_value_below_the_resolution_is_not_certified_but_a_flat_loss_is():
    clean = 1.0
    r = loss_resolution("bfloat16", clean)
    below = dict(max_loss=clean + 0.5 * r, clean_loss=clean, gap=1e-4, start_values=[0.5 * r] * 2,
                 start_gaps=[1e-4] * 2, start_kinds=["zero", "antipode"])
    state, note = SolveResult(**below, dtype="bfloat16").verdict(1e-3, 2)
    assert state == NOT_CERTIFIED and "below the resolution" in note
    assert SolveResult(**below, dtype="float32").verdict(1e-3, 2) == (CERTIFIED, None)  # float32 resolves it
    flat = dict(below, max_loss=clean, gap=0.0, start_values=[0.0] * 2, start_gaps=[0.0] * 2)
    assert SolveResult(**flat, dtype="bfloat16").verdict(1e-3, 2) == (CERTIFIED, None)  # no gradient: exact
    above = dict(below, max_loss=clean + 4 * r, start_values=[4 * r, 4 * r - 0.5 * r], gap=0.3 * r / (4 * r))
    assert SolveResult(**above, dtype="bfloat16").verdict(1e-3, 2)[0] == AT_PRECISION
