"""The solver: AS23's checkpoint schedule, its blocked ellipsoid projection against the whole-vector formula, and
the Gram-matrix bookkeeping of the iterates against recomputed norms."""

from __future__ import annotations

import pytest
import torch

from hf_geosharp.engine.solvers.apgd import as23_checkpoints
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_batches, tiny_bert


def test_as23_checkpoint_schedule():
    assert as23_checkpoints(20) == [5, 9, 12, 15, 16, 18, 19, 20]


def test_blocked_ellipsoid_projection_matches_the_reference_formula(monkeypatch):
    """AS23's projection, evaluated block by block, against the reference's whole-vector formula (docs/spec.md §5.1)."""
    from hf_geosharp.engine.solvers import as23 as solver

    monkeypatch.setattr(solver, "_BLOCK", 1000)  # many blocks, and a ragged last one
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10_500, generator=g, dtype=torch.float64)
    w[::7] = 0.0  # frozen coordinates: 1/|w| = 0
    inv = torch.where(w != 0, 1.0 / w.abs().clamp_min(1e-300), 0.0)
    for scale, rho in ((0.01, 0.5), (1.0, 0.5), (5.0, 0.05)):
        delta = scale * torch.randn(w.shape, generator=g, dtype=torch.float64) * w.abs()
        expected = delta.clone()
        norm = lambda lmbd, expected=expected: float((expected / (1 + 2 * lmbd * inv**2) * inv).norm())  # noqa: E731
        new_norm, lmbd, lo, hi, limit, used = norm(0.0), 0.1, 0.0, 10.0, 10.0, None
        while norm(0.0) > rho and abs(new_norm - rho) > 1e-5:
            used, new_norm = lmbd, norm(lmbd)
            lmbd, lo, hi = ((lmbd + hi) / 2, lmbd, hi) if new_norm > rho else ((lo + lmbd) / 2, lo, lmbd)
            if limit - hi < 1e-2:
                limit, hi = 2 * limit, 2 * hi
        if used is not None:
            expected = expected / (1 + 2 * used * inv**2)
        got = solver._ellipsoid_projection(delta.clone(), inv, rho)
        assert torch.allclose(got, expected, rtol=1e-12, atol=0)
        assert float((got * inv).norm()) <= rho + 1e-5


def test_solver_bookkeeping_keeps_iterates_in_the_ball():
    """Iterates never leave the ball, and the best iterate's norm from the Gram bookkeeping is its real norm."""
    from hf_geosharp.engine.model_function import objective as objective_module
    from hf_geosharp.engine.placement.base import Holding
    from hf_geosharp.engine.placement.single import SingleProcess
    from hf_geosharp.engine.solvers.apgd import apgd

    model = tiny_bert()
    names, params = objective_module.measured_parameters(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in params])
    space = PerturbationSpace(theta0, map_symmetries(model).blocks, SpaceOptions("inv", epsilon=0.0))
    placement = SingleProcess(model)
    placement.hold(Holding.whole(names, params), [])
    objective = objective_module.Objective(model, space, placement, objective_module.default_loss, 0.5)
    objective.batch = tiny_batches(1)[0]
    seen: list[tuple[float, float]] = []

    def recording(xi, need_grad, out=None):
        loss, grad = objective(xi, need_grad, out=out)
        seen.append((loss, float(space.norm(xi))))
        return loss, grad

    result = apgd(space, recording, rho=0.5, steps=8)
    assert max(norm for _, norm in seen) <= 0.5 * (1 + 1e-9)
    best = next(norm for loss, norm in seen if loss == result.max_loss)
    assert result.best_norm == pytest.approx(best, rel=1e-9, abs=1e-12)
