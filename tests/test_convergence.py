"""The convergence certificate (docs/method.md, "Convergence"): ``converged=True`` only where the value is the
maximum, checked against an independent maximiser on fp64 tiny BERTs with noisy weights, not against numbers the
solver printed (``experiments/convergence_audit.py``'s maximiser: projected gradient ascent with Armijo backtracking
from random starts, on the space's slow paths)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_geosharp as gs
from experiments.convergence_audit import independent_maximum
from hf_geosharp.engine.solvers.apgd import apgd
from hf_geosharp.engine.solvers.certificate import relative_gap
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions

from .fixtures.hf_models import one_thread, tiny_bert  # noqa: F401  (autouse: one torch thread for tiny models)
from .test_engine_defaults import _batches, _noisy_bert

MEASURES = ("inv", "mix", "adaptive")
RHOS = (0.1, 0.5, 1.0)


def _measure(model, batches, measure: str, **kw) -> gs.SharpnessResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        if measure == "adaptive":
            return gs.adaptive_sharpness(model, batches, progress=False, **kw)
        return gs.geodesic_sharpness(model, batches, metric=measure, progress=False, **kw)


@pytest.fixture(scope="module")
def noisy():
    return _noisy_bert(0.2), _batches(n=1)


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("measure", MEASURES)
def test_auto_is_converged_only_at_the_maximum(noisy, measure, rho):
    """``steps="auto"`` reaches >= 98 % of the best known maximum, or says it is not converged; and a fixed-step
    run that calls itself converged is there too."""
    model, batches = noisy
    auto = _measure(model, batches, measure, rho=rho, steps="auto")
    short = _measure(model, batches, measure, rho=rho, steps=5)
    best = max(independent_maximum(model, batches[0], measure, rho), auto.value, short.value)
    for res in (auto, short):
        assert res.converged == (res.convergence_note is None)
        if res.converged:
            assert res.value >= 0.98 * best, (res.config["steps"], res.value, best)
            assert res.stationarity_gap <= res.config["tol"]
        else:
            assert res.convergence_note and "NOT converged" in str(res)
    if rho == 0.1:  # a near-linear landscape: certified, and cheaply
        assert auto.converged and auto.steps_used <= 30, auto.steps_used


def test_a_short_window_or_a_plateau_at_the_budget_is_not_converged(noisy):
    """5 steps at rho 1.0 are far from the maximum and not converged, however flat their last steps look; an auto run
    that ends on its budget is not converged and says that the budget ran out."""
    model, batches = noisy
    short = _measure(model, batches, "mix", rho=1.0, steps=5)
    assert not short.converged and "not stationary" in short.convergence_note
    budget = _measure(model, batches, "inv", rho=1.0, steps="auto", max_steps=30)
    assert not budget.converged and budget.steps_used == 30
    assert "not stationary" in budget.convergence_note or "budget" in budget.convergence_note


@pytest.mark.parametrize("rho", (0.1, 1.0))
def test_as23_stall_is_never_called_converged(noisy, rho):
    """AS23's fixed point is not the maximum of its own objective: its Frank-Wolfe gap stays above the tolerance at
    any step count, so it is never certified."""
    model, batches = noisy
    clean = _measure(model, batches, "adaptive", rho=rho, steps="auto")
    for steps in (20, "auto"):
        as23 = _measure(model, batches, "adaptive", rho=rho, steps=steps, variant="as23", max_steps=100)
        assert not as23.converged and "not stationary" in as23.convergence_note
        assert as23.value < clean.value


def test_the_gap_is_the_exact_distance_to_the_maximum_of_a_linear_objective():
    """For ``f(xi) = <c, xi>`` the maximum over the ball is ``rho ||R c||_g`` and, at any feasible ``xi``, the
    Frank-Wolfe gap equals ``max - f(xi)`` exactly (concave, and first order is all there is)."""
    model = tiny_bert().double()
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    space = PerturbationSpace(theta, gs.map_symmetries(model).blocks, SpaceOptions("inv"))
    c = torch.randn(theta.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rho = 0.3

    def linear(xi, need_grad, out=None):
        value = float(torch.dot(c, xi))
        return value, (out.copy_(c) if out is not None else c.clone()) if need_grad else None

    maximum = rho * float(space.norm(space.horizontal(space.riemannian_gradient(c))))
    res = apgd(space, linear, rho=rho, steps=20, max_steps=200, tol=1e-9)
    assert res.sharpness == pytest.approx(maximum, rel=1e-9) and res.gap <= 1e-9
    d = space.horizontal(space.riemannian_gradient(c))
    noise = space.random_tangent_vector(torch.Generator().manual_seed(1))
    noise = noise * (float(space.norm(d)) / float(space.norm(noise)))
    for scale in (0.1, 1.0, 3.0):  # ever farther from the maximiser
        xi = space.project(d + scale * noise, rho)
        value = float(torch.dot(c, xi))
        assert 0 < value < maximum
        gap = relative_gap(rho, float(space.inner_product(d, d)), float(space.inner_product(d, xi)), value)
        assert gap * value == pytest.approx(maximum - value, rel=1e-9, abs=1e-12)
