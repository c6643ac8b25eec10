"""The solver: AS23's checkpoint schedule, its blocked ellipsoid projection against the whole-vector formula, the
Gram-matrix bookkeeping of the iterates against recomputed norms, and the kept best-point gradient against its
recomputation (same bits, fewer model calls) with the memory rule that chooses between them."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_geosharp.engine.solvers.memory import Footprint, keeps_best_gradient, workspace_room
from hf_geosharp.engine.solvers.schedule import as23_checkpoints
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_batches, tiny_bert
from .fixtures.objective import tiny_objective


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


def test_blocked_as23_gap_matches_the_whole_vector_formula(monkeypatch):
    """AS23's Frank-Wolfe gap, summed block by block, against ``relative_gap`` on whole float64 vectors."""
    from hf_geosharp.engine.solvers import as23 as solver
    from hf_geosharp.engine.solvers.certificate import relative_gap

    monkeypatch.setattr(solver, "_BLOCK", 1000)  # many blocks, and a ragged last one
    g = torch.Generator().manual_seed(1)
    egrad, scale, delta = (torch.randn(10_500, generator=g) for _ in range(3))
    scale[::7] = 0.0  # frozen coordinates
    delta *= 1e-3  # <egrad, delta> below rho ||egrad |w| ||: every gap below is positive, so the sum is tested
    e, s = egrad.double(), scale.double()
    for rho, value in ((0.1, 2.0), (1.0, 0.5), (0.01, 30.0)):
        expected = relative_gap(rho, float((e * s).square().sum()), float(e @ delta.double()), value)
        assert expected > 0 and solver._gap(egrad, scale, delta, rho, value) == pytest.approx(expected, rel=1e-5)


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


def _counted_solve(model, metric, keep, rho, **kw):
    """A solve of the tiny BERT's first batch with the best point's gradient kept or recomputed; the result and the
    number of gradients taken."""
    from hf_geosharp.engine.solvers.apgd import apgd

    space, objective = tiny_objective(model, metric, rho)
    gradients = [0]

    def counted(xi, need_grad, out=None):
        gradients[0] += need_grad
        return objective(xi, need_grad, out=out)

    return apgd(space, counted, rho=rho, keep_best_gradient=keep, **kw), gradients[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("metric", ["inv", "mix", None])
def test_kept_best_gradient_gives_the_same_bits_as_its_recomputation(dtype, metric):
    """Keeping the best point's gradient replaces a forward and backward at the same point on the same batch, which
    gives the same bits on a CPU: every loss, the value, the best point's norm and its gap are identical, with fewer
    gradients taken (the solve does restart from earlier best points)."""
    model = tiny_bert(dtype)
    for kw in (dict(steps=20), dict(steps=20, max_steps=60, tol=1e-6)):  # fixed steps, and steps="auto"'s starts
        recomputed, n_recomputed = _counted_solve(model, metric, False, 5.0, **kw)
        kept, n_kept = _counted_solve(model, metric, True, 5.0, **kw)
        assert kept.losses == recomputed.losses and len(kept.losses) > 20
        assert (kept.max_loss, kept.clean_loss, kept.best_norm) == (
            recomputed.max_loss, recomputed.clean_loss, recomputed.best_norm)
        assert kept.gap == recomputed.gap or (kept.gap != kept.gap and recomputed.gap != recomputed.gap)
        assert (kept.start_values, kept.start_gaps) == (recomputed.start_values, recomputed.start_gaps)
        assert n_kept < n_recomputed


def test_default_rule_keeps_the_gradient_where_it_fits_and_recomputes_where_it_does_not(monkeypatch):
    """The runner passes the memory rule, which measures the footprint at the clean point:
    a model whose vectors are short next to its parameters (most embedding rows unused) and whose batch has large
    activations keeps the gradient; the tiny geodesic space, whose workspace alone exceeds the bytes goal,
    recomputes it. Either way the number is the one of a solve that recomputes."""
    import hf_geosharp as gs
    from hf_geosharp.engine.model_function import objective as objective_module
    from hf_geosharp.engine.solvers import memory as solver

    wide = tiny_bert(torch.float64)
    wide.resize_token_embeddings(4000, mean_resizing=False)  # rows no batch looks up: short vectors
    cases = {"kept": (lambda: gs.adaptive_sharpness(wide, tiny_batches(1, rows=32, length=32), variant="clean",
                                                    rho=10.0, steps=20, progress=False)),
             "recomputed": (lambda: gs.geodesic_sharpness(tiny_bert(torch.float64), tiny_batches(1), metric="inv",
                                                          rho=5.0, steps=20, progress=False))}
    gradients = [0]
    call = objective_module.Objective.on_device  # what the runner hands the solver

    def counted(self, xi, need_grad, out=None):
        gradients[0] += need_grad
        return call(self, xi, need_grad, out=out)

    pending = objective_module.Objective.pending  # the last iterate's gradient, taken where it is the best point

    @contextlib.contextmanager
    def counted_pending(self, xi, out):
        with pending(self, xi, out) as (value, take):
            def counted_take():
                gradients[0] += 1
                take()

            yield value, counted_take

    monkeypatch.setattr(objective_module.Objective, "on_device", counted)
    monkeypatch.setattr(objective_module.Objective, "pending", counted_pending)
    rule = solver.keeps_best_gradient
    for expected, measure in cases.items():
        runs = []
        for keeps in (rule, lambda footprint: False):
            monkeypatch.setattr(solver, "keeps_best_gradient", keeps)
            gradients[0] = 0
            runs.append((measure().value, gradients[0]))
        (value, n_rule), (value_recomputed, n_recomputed) = runs
        assert value == value_recomputed and n_recomputed > 20 + 1  # the solve restarts from earlier best points
        assert (n_rule < n_recomputed) if expected == "kept" else (n_rule == n_recomputed)


MB = 10**6
MINILM = (22_714_371, 90_857_484)  # parameters, bytes of weights
BERT_BASE = (109_484_547, 437_938_188)


@pytest.mark.parametrize(("model", "vector", "space", "activations", "kept"), [
    (MINILM, 46.4, 0.0, 154.6, True),  # 1024 tokens a batch: four vectors miss the peak goal anyway, five fit 16 B
    (MINILM, 46.4, 14.6, 154.6, True),
    (MINILM, 46.4, 0.0, 309.1, False),  # 16 x 128 tokens: four vectors meet the peak goal, five would not
    (MINILM, 46.4, 14.6, 309.1, False),
    (MINILM, 54.4, 14.6, 1236.5, True),  # 64 x 128 tokens: five vectors meet the peak goal
    (BERT_BASE, 349.1, 0.0, 1222.2, False),  # 16 x 128 tokens, adaptive: five vectors at 15.94 bytes per parameter,
    # within 16 but not within its margin (measured with five: 16.04)
    (BERT_BASE, 340.0, 0.0, 1222.2, True),  # a vector 3 % shorter: five within the margin, the peak goal out of reach
    (BERT_BASE, 349.1, 101.0, 1222.2, False),  # geodesic: its caches and workspace take them past it
])
def test_the_memory_rule(model, vector, space, activations, kept):
    """The rule on the footprints of the benchmarks' random BERTs (MB; the activations as a plain forward+backward
    saves them at these batch sizes, the vectors over the coordinates the solver holds)."""
    parameters, weights = model
    footprint = Footprint(int(vector * MB), int(space * MB), parameters, weights, int(activations * MB))
    assert keeps_best_gradient(footprint) is kept


BERT_LARGE = 335_141_888  # parameters (24 x 1024, 16 heads)


def test_the_workspace_room_rule():
    """The bytes goal alone where the device's free memory is not known (a CPU); on a GPU with room, a share of what
    is free beside the solver's vectors, where that is more; never less than the goal gives, never negative."""
    vector = 4 * 304_000_000  # BERT-large's perturbed coordinates (its used embedding rows), float32
    goal = workspace_room(BERT_LARGE, vector)
    assert goal == int(0.98 * 16 * BERT_LARGE) - 4 * vector
    one_chunk = (151_000_000 + 101_000_000) * 4  # its pair geometry's scratch and base-point copy (launch suite)
    assert goal < one_chunk
    gpu = workspace_room(BERT_LARGE, vector, free=80 * 10**9)
    assert gpu == int(0.5 * (80 * 10**9 - 5 * vector)) and gpu > one_chunk
    assert workspace_room(BERT_LARGE, vector, free=10**9) == goal  # a full GPU: the goal still holds
    assert workspace_room(10, 4 * 100) == 0


class _Line:
    """A Euclidean space over ``R^n`` and a loss that depends on one direction ``v`` only:
    ``f(t) = t^2 + 0.2 t - 0.5 t^3`` with ``t = <v, xi> / rho``. Its maxima on the ball are ``rho v`` (0.7, towards
    which the gradient at zero points, and where random points of the sphere climb) and ``-rho v`` (1.3, the
    maximum, reached only from its side)."""

    held_bytes = 0

    def __init__(self, n: int, rho: float) -> None:
        self.n, self.rho = n, rho
        self.v = torch.zeros(n, dtype=torch.float64)
        self.v[0] = 1.0

    def zero(self):
        return torch.zeros(self.n, dtype=torch.float64)

    def empty(self):
        return torch.empty(self.n, dtype=torch.float64)

    def ascent_direction(self, egrad, vectors, out, save=None):
        out.copy_(egrad)
        if save is not None:
            save.copy_(egrad)
        return out, float(out @ out), [float(row @ out) for row in vectors]

    def random_tangent_vector(self, generator):
        return torch.randn(self.n, generator=generator, dtype=torch.float64)

    def norm(self, xi):
        return xi.norm()

    def total(self, values):
        return values

    def objective(self, xi, need_grad, out=None):
        t = float(self.v @ xi) / self.rho
        loss = 1.0 + t * t + 0.2 * t - 0.5 * t**3
        if not need_grad:
            return loss, None
        grad = out if out is not None else self.empty()
        return loss, grad.copy_(self.v).mul_((2 * t + 0.2 - 1.5 * t * t) / self.rho)


def test_auto_certifies_a_maximum_that_only_its_own_side_reaches():
    """Two maxima: the climb from zero finds the lower one, the antipode start the higher, and random points of the
    sphere climb to the lower one again (the gradient points there almost everywhere). A third start that begins
    near the best point reaches it again, which certifies it; random starts would never have agreed on it. As the
    starts found two maxima, two starts from random points look for a higher one: they climb to the lower one and
    refute nothing."""
    from hf_geosharp.engine.solvers.apgd import apgd

    line = _Line(2000, rho=0.3)
    res = apgd(line, line.objective, rho=line.rho, steps=20, max_steps=400, keep_best_gradient=False,
               generator=torch.Generator().manual_seed(0))
    assert res.start_values[0] == pytest.approx(0.7, rel=1e-3)  # the lower maximum first
    assert res.sharpness == pytest.approx(1.3, rel=1e-3)
    assert res.certificate(1e-3, starts=2) is None, res.certificate(1e-3, starts=2)
    assert len(res.start_values) == 5 and res.start_values[2] == pytest.approx(1.3, rel=1e-3)
    assert res.start_kinds == ["zero", "antipode", "near", "random", "random"]
    assert max(res.start_values[3:]) == pytest.approx(0.7, rel=1e-3)
    # the starts the solver used before: random points of the sphere all climb to the lower maximum
    for seed in range(5):
        z = line.random_tangent_vector(torch.Generator().manual_seed(seed))
        start = z * (line.rho / float(z.norm()))
        t = float(line.v @ start) / line.rho
        assert 2 * t + 0.2 - 1.5 * t * t > 0  # the gradient along v points to the lower maximum


def test_max_starts_bounds_the_starts_and_changes_nothing_once_two_agree():
    """Starts stop at the certificate: a larger ``max_starts`` repeats a certified run bit for bit (the MiniLM
    population's numbers certified within four starts did not move when the default became eight), and too few
    starts leave the disagreement in the note."""
    from hf_geosharp.engine.solvers.apgd import AUTO_MAX_STARTS, apgd

    line = _Line(2000, rho=0.3)

    def solve(max_starts):
        return apgd(line, line.objective, rho=line.rho, steps=20, max_steps=400, keep_best_gradient=False,
                    generator=torch.Generator().manual_seed(0), max_starts=max_starts)

    few, four, five, default = solve(2), solve(4), solve(5), solve(AUTO_MAX_STARTS)
    assert len(few.start_values) == 2
    assert few.certificate(1e-3, starts=2) == "2 starts reached different maxima (0.7, 1.3)"
    assert "random points" in four.certificate(1e-3, starts=2)  # one of the two random starts only
    assert five.certificate(1e-3, starts=2) is None
    assert default.losses == five.losses
    assert (default.start_values, default.start_gaps) == (five.start_values, five.start_gaps)
    assert len(five.start_values) == 5 < AUTO_MAX_STARTS


class _Bowl(_Line):
    """A loss that rises steeply outward and gently along the sphere: ``f = 1 + R |xi|^2 / rho^2 + A x + S (y + c)^2``
    with ``x = <u, xi> / rho``, ``y = <v, xi> / rho``. The maximum lies on the sphere in the ``(u, v)`` plane (the
    other coordinates only add to the radial term). At a point of the sphere the Frank-Wolfe gap is about
    ``rho t^2 / (2 r)`` for a slope ``t`` along the sphere and ``r`` outward: quadratic in ``t``, and small where ``r``
    is large, although the loss still rises along the sphere."""

    def __init__(self, n: int, rho: float, radial: float, a: float, s: float, c: float) -> None:
        super().__init__(n, rho)
        self.radial, self.a, self.s, self.c = radial, a, s, c
        self.u = torch.zeros(n, dtype=torch.float64)
        self.u[1] = 1.0

    def maximum(self) -> float:
        """The largest sharpness on the ball (the maximum over the circle of radius rho in the (u, v) plane)."""
        angle = torch.linspace(0, 2 * math.pi, 200_001, dtype=torch.float64)
        on_circle = self.radial + self.a * torch.cos(angle) + self.s * (torch.sin(angle) + self.c) ** 2
        return float(on_circle.max()) - self.s * self.c**2

    def objective(self, xi, need_grad, out=None):
        x, y = float(self.u @ xi) / self.rho, float(self.v @ xi) / self.rho
        loss = 1.0 + self.radial * float(xi @ xi) / self.rho**2 + self.a * x + self.s * (y + self.c) ** 2
        if not need_grad:
            return loss, None
        grad = out if out is not None else self.empty()
        grad.copy_(xi).mul_(2 * self.radial / self.rho**2).add_(self.u, alpha=self.a / self.rho)
        return loss, grad.add_(self.v, alpha=2 * self.s * (y + self.c) / self.rho)


def _bowl_out_of_strict_reach(monkeypatch, host_steps: bool):
    """The bowl below with the strict stop out of reach (a slope bound no climb meets), and its auto solve."""
    from hf_geosharp.engine.solvers import climb as solver
    from hf_geosharp.engine.solvers.apgd import apgd

    monkeypatch.setattr(solver, "SLOPE_STOP_FRACTION", 1e12)
    bowl = _Bowl(200, rho=0.3, radial=10.0, a=1.0, s=2.0, c=0.1)

    def solve():
        return apgd(bowl, bowl.objective, rho=bowl.rho, steps=20, max_steps=640, keep_best_gradient=False,
                    host_steps=host_steps, generator=torch.Generator().manual_seed(0))

    return bowl, solve


@pytest.mark.parametrize("host_steps", [True, False], ids=["host", "device"])
def test_a_start_whose_block_stalls_stops_on_the_certificates_gap(monkeypatch, host_steps):
    """With the strict stop out of reach (a slope bound no climb meets), a start still stops once a whole block
    raises its best loss by at most ``START_STOP_FRACTION * tol`` of the value and its gap is within ``tol``: auto
    certifies within its budget and within ``tol`` of the maximum, on the host reference and the device climb
    alike. Without that rule each start climbs on until its gap and slope reach rounding, and the solve takes more
    steps."""
    from hf_geosharp.engine.solvers import climb as solver

    bowl, solve = _bowl_out_of_strict_reach(monkeypatch, host_steps)

    res = solve()
    assert res.certificate(1e-3, starts=len(res.start_values)) is None, res.certificate(1e-3, starts=2)
    assert res.steps_used < 640
    assert res.sharpness == pytest.approx(bowl.maximum(), rel=1e-3)
    assert max(res.start_gaps) <= 1e-3
    monkeypatch.setattr(solver.Climb, "stalled", lambda self, best_loss, block_start: False)
    spun = solve()
    assert spun.steps_used > res.steps_used


def test_auto_certifies_within_tol_of_the_maximum_where_the_loss_rises_steeply_outward(monkeypatch):
    """A start stopped at a gap of ``tol`` would sit 0.6 % below the maximum here, and a second start agreed with it
    (certified, wrongly); a start stops at a tenth of ``tol`` instead, and only where its slope along the sphere is
    small too, and the certified value is within ``tol``."""
    from hf_geosharp.engine.solvers import climb as solver
    from hf_geosharp.engine.solvers.apgd import apgd
    from hf_geosharp.engine.solvers.climb import START_STOP_FRACTION

    bowl = _Bowl(200, rho=0.3, radial=10.0, a=1.0, s=2.0, c=0.1)
    res = apgd(bowl, bowl.objective, rho=bowl.rho, steps=20, max_steps=640, keep_best_gradient=False,
               generator=torch.Generator().manual_seed(0))
    assert res.certificate(1e-3, starts=2) is None, res.certificate(1e-3, starts=2)
    assert res.sharpness == pytest.approx(bowl.maximum(), rel=1e-3)
    assert res.start_gaps[0] <= 1e-3 * START_STOP_FRACTION  # the first start, the strict stop; checks: tol
    assert max(res.start_gaps) <= 1e-3
    # with the slope stop, even a start stopped at a gap of 1e-3 ends within 3e-3 of the maximum
    sloped = apgd(bowl, bowl.objective, rho=bowl.rho, steps=20, max_steps=640, keep_best_gradient=False,
                  tol=1e-3 / START_STOP_FRACTION, generator=torch.Generator().manual_seed(0))
    assert sloped.start_values[0] >= bowl.maximum() * (1 - 3e-3)
    # a stop on the gap alone, at 1e-3: the climb from zero ends well below the maximum
    monkeypatch.setattr(solver, "SLOPE_STOP_FRACTION", 0.0)
    early = apgd(bowl, bowl.objective, rho=bowl.rho, steps=20, max_steps=640, keep_best_gradient=False,
                 tol=1e-3 / START_STOP_FRACTION, generator=torch.Generator().manual_seed(0))
    assert early.start_gaps[0] <= 1e-3
    assert early.start_values[0] < bowl.maximum() * (1 - 3e-3)


@pytest.mark.parametrize("host_steps", [True, False], ids=["host", "device"])
def test_a_checking_start_stops_once_it_agrees_with_the_best_value(monkeypatch, host_steps):
    """A start after the first stops as soon as its best point is within ``tol`` of the best value found so far and
    stationary within ``tol``: the certificate then holds, and the value is the one the start would have polished
    further, to ``tol``. With the strict stop out of reach (a slope bound no climb meets), the checking starts that
    reach the best value otherwise run until a whole block stalls: the agreement spares those steps, on the host
    reference and the device climb alike."""
    from hf_geosharp.engine.solvers import climb as solver

    bowl, solve = _bowl_out_of_strict_reach(monkeypatch, host_steps)

    agreed = solve()
    monkeypatch.setattr(solver.Agreement, "with_best", classmethod(lambda cls, *args: cls(math.inf, -math.inf)))
    unchecked = solve()
    for res in (agreed, unchecked):
        assert res.certificate(1e-3, starts=len(res.start_values)) is None, res.certificate(1e-3, starts=2)
        assert res.sharpness == pytest.approx(bowl.maximum(), rel=1e-3)
    assert agreed.start_values[0] == unchecked.start_values[0]  # the first start is the same climb
    assert agreed.steps_used < unchecked.steps_used
