"""The radius convention (``ball``): each attention pair's metric multiplied by a group-invariant constant so that
scaling a head's factors has the norm adaptive sharpness gives it (docs/method.md, "Radius convention").

Checked on a tiny fp64 BERT with every weight nonzero: the scaling-direction property per metric, the invariance of
the weights under condition-1000 group elements, and that a constant per pair leaves the horizontal space and the
geodesics alone while it scales norms by ``sqrt(w)``, Riemannian gradients by ``1/w`` and random draws by
``1/sqrt(w)``. The fast space against the dense reference under both balls is in tests/test_reference_space.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.engine.geometry.gl_quotient import GLQuotient
from hf_geosharp.engine.settings import RunSettings
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions, pair_weights
from hf_geosharp.engine.space.reference_space import calibration_weight
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert

METRICS = ("inv", "mix")


def _theta(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module")
def bert():
    """The tiny BERT (biases nonzero: adaptive sharpness measures every coordinate), its weights and pair blocks,
    with the weights moved off the 0.02 init so that heads differ in scale."""
    model = tiny_bert()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    theta = _theta(model)
    assert bool((theta != 0).all())
    return model, theta, map_symmetries(model).blocks


def _heads(blocks):
    """Every head as ``(G index, H index)`` (``[n, h]``, ``[m, h]``)."""
    return [(b.G_index[k], b.H_index[k]) for b in blocks for k in range(b.n_pairs)]


def _head_norms(space: PerturbationSpace, xi: torch.Tensor) -> torch.Tensor:
    return torch.cat([m for m, _ in space.pair_products(xi, xi)]).sqrt()


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("epsilon", [0.0, 1e-6])
def test_scaling_a_head_has_its_adaptive_norm_in_the_calibrated_ball_and_not_in_the_papers(bert, metric, epsilon):
    """``(G, H) -> (1 + t)(G, H)`` is horizontal; its calibrated inv norm is ``t sqrt((n + m) h)``, the adaptive norm
    of the same change, head by head, and its calibrated mix norm is at least that (the mix ball lies inside the inv
    ball), where the paper's metric gives ``t sqrt(2h)`` (inv) or ``t sqrt(2) ||G H^T||_F`` (mix)."""
    _, theta, blocks = bert
    t = 0.03
    calibrated = PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon, ball="calibrated"))
    paper = PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon, ball="paper"))
    adaptive = PerturbationSpace(theta, [], SpaceOptions(None))
    rel = 1e-10 if epsilon == 0 else 10 * epsilon
    paper_norms, mix_over_adaptive = [], []
    for G_index, H_index in _heads(blocks):
        xi = torch.zeros_like(theta)
        xi[G_index], xi[H_index] = t * theta[G_index], t * theta[H_index]
        norms = _head_norms(calibrated, xi)
        head = int(norms.argmax())
        assert float(norms.sort().values[-2]) == 0  # one head moves
        entries = G_index.numel() + H_index.numel()
        assert float(adaptive.norm(xi)) == pytest.approx(t * entries**0.5, rel=1e-12)
        if metric == "inv":
            assert float(norms[head]) == pytest.approx(float(adaptive.norm(xi)), rel=rel)
        else:
            mix_over_adaptive.append(float(norms[head]) / float(adaptive.norm(xi)))
        assert float(calibrated.norm(calibrated.horizontal(xi))) == pytest.approx(float(norms[head]), rel=rel)
        G, H = theta[G_index], theta[H_index]
        expected = (2 * G.shape[1]) ** 0.5 if metric == "inv" else 2**0.5 * float(torch.linalg.norm(G @ H.mT))
        paper_norms.append(float(_head_norms(paper, xi)[head]) / t)
        assert paper_norms[-1] == pytest.approx(expected, rel=rel)
    adaptive_norm = (G_index.numel() + H_index.numel()) ** 0.5  # equal-sized heads
    assert max(abs(n / adaptive_norm - 1) for n in paper_norms) > 0.5  # the paper's ball is another size
    # mix: sqrt(tau / lambda_min(P Q)) >= 1 times adaptive's, and more where a head's singular values spread
    if metric == "mix":
        assert all(r >= 1 - rel for r in mix_over_adaptive) and max(mix_over_adaptive) > 1.5


@pytest.mark.parametrize("epsilon", [0.0, 1e-6])
def test_the_calibrated_mix_ball_lies_inside_the_calibrated_inv_ball_and_touches_it(bert, epsilon):
    """``w_mix = w_inv / lambda_min(P Q)`` is the smallest weight with ``||xi||_mix >= ||xi||_inv`` for every ``xi``
    (horizontal or not), head by head: random directions are longer under mix, and the direction ``xi_G = a u^T``
    with ``P Q u = lambda_min u`` (``xi_H = 0``) has the same length under both."""
    _, theta, blocks = bert
    spaces = {metric: PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon)) for metric in METRICS}
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(theta.shape, generator=gen, dtype=torch.float64)
        mix, inv = (_head_norms(spaces[metric], x) for metric in ("mix", "inv"))
        assert bool((mix >= inv * (1 - 1e-12)).all()), (mix / inv).min()
    ratios = []
    for G_index, H_index in _heads(blocks):
        G, H = theta[G_index], theta[H_index]
        P, Q = GLQuotient.relaxed_grams((G.mT @ G)[None], (H.mT @ H)[None], epsilon)
        values, vectors = torch.linalg.eig(P[0] @ Q[0])
        u = vectors[:, int(values.real.argmin())].real
        xi = torch.zeros_like(theta)
        xi[G_index] = torch.outer(torch.randn(G.shape[0], generator=gen, dtype=torch.float64), u)
        ratios.append(float(_head_norms(spaces["mix"], xi).max() / _head_norms(spaces["inv"], xi).max()))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


@pytest.mark.parametrize("metric", METRICS)
def test_the_weights_are_invariant_under_condition_1000_group_elements(bert, metric):
    model, theta, blocks = bert
    moved = copy.deepcopy(model)
    gs.reparametrize(moved, seed=3, condition=1000.0)
    theta_moved = _theta(moved)
    assert float((theta_moved - theta).norm()) > 0.5 * float(theta.norm())
    weights = [PerturbationSpace(th, blocks, SpaceOptions(metric, 0.0)).pairs for th in (theta, theta_moved)]
    for before, after in zip(*weights):
        assert before.weight is not None and bool((before.weight > 0).all())
        torch.testing.assert_close(after.weight, before.weight, rtol=1e-9, atol=0)
    if metric == "mix":  # the weights follow each head's smallest singular value of G H^T: they differ
        w = torch.cat([group.weight for group in weights[0]])
        assert float(w.max() / w.min()) > 1.2


@pytest.mark.parametrize("mode", ["worst", "average"])
@pytest.mark.parametrize("metric", METRICS)
def test_calibrated_geodesic_sharpness_is_invariant_at_condition_1000_and_differs_from_the_papers(bert, metric, mode):
    """The whole measurement under the calibrated ball at the default epsilon, the model and a copy moved by
    condition-1000 group elements (same function): equal to 1e-6 (fixed steps: the iterates are equivariant)."""
    model, _, _ = bert
    moved = copy.deepcopy(model)
    gs.reparametrize(moved, seed=3, condition=1000.0)
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(5, 100, (4, 8), generator=gen), "labels": torch.randint(0, 3, (4,),
                generator=gen)} for _ in range(2)]
    kw = dict(rho=0.1, metric=metric, mode=mode, steps=8, n_samples=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        before, after = (gs.geodesic_sharpness(m, batches, **kw) for m in (model, moved))
        paper = gs.geodesic_sharpness(model, batches, ball="paper", **kw)
    assert before.config["ball"] == "calibrated" and paper.config["ball"] == "paper"
    assert abs(after.value - before.value) <= 1e-6 * abs(before.value), (before.value, after.value)
    assert abs(paper.value - before.value) > 1e-3 * abs(before.value)  # the ball matters


@pytest.mark.parametrize("metric", METRICS)
def test_a_constant_per_pair_scales_norms_gradients_and_draws_and_leaves_projection_and_geodesics(bert, metric):
    _, theta, blocks = bert
    spaces = {ball: PerturbationSpace(theta, blocks, SpaceOptions(metric, 1e-6, ball=ball))
              for ball in ("calibrated", "paper")}
    cal, pap = spaces["calibrated"], spaces["paper"]
    w = [calibration_weight(theta[G_index], theta[H_index], metric, 1e-6) for G_index, H_index in _heads(blocks)]
    assert all(g.weight is None for g in pap.pairs)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(theta.shape, generator=gen, dtype=torch.float64) * theta.abs()
    egrad = torch.randn(theta.shape, generator=gen, dtype=torch.float64)
    # the horizontal space and the geodesic are the paper's
    torch.testing.assert_close(cal.horizontal(x), pap.horizontal(x), rtol=1e-12, atol=0)
    xi = 0.3 * pap.horizontal(x)
    points = []
    for space in (cal, pap):
        point, grad = torch.empty_like(theta), egrad.clone()
        space.exp_point(xi, point, True)(grad)
        points.append((point, grad))
    assert all(torch.equal(a, b) for a, b in zip(*points))
    # per head: norms times sqrt(w), gradients over w, draws over sqrt(w)
    weights = torch.cat([g.weight for g in cal.pairs])  # in the space's head order, as the breakdown reads it
    torch.testing.assert_close(_head_norms(cal, xi), _head_norms(pap, xi) * weights.sqrt(), rtol=1e-12, atol=0)
    for vector, power in ((cal.riemannian_gradient(egrad), -1.0),
                          (cal.random_tangent_vector(torch.Generator().manual_seed(2)), -0.5)):
        other = pap.riemannian_gradient(egrad) if power == -1 else pap.random_tangent_vector(
            torch.Generator().manual_seed(2))
        for (G_index, H_index), wk in zip(_heads(blocks), w):
            for index in (G_index, H_index):
                torch.testing.assert_close(vector[index], other[index] * wk**power, rtol=1e-10, atol=1e-15)
    # outside the pairs nothing changes
    outside = torch.ones_like(theta, dtype=torch.bool)
    for G_index, H_index in _heads(blocks):
        outside[G_index] = outside[H_index] = False
    assert torch.equal(cal.riemannian_gradient(egrad)[outside], pap.riemannian_gradient(egrad)[outside])


def test_pair_weights_formula_the_relaxations_floor_and_a_dead_head():
    """``(n + m)/2`` for inv; ``(n + m) / (2 lambda_min(P Q))`` for mix: at ``epsilon = 0`` the smallest squared
    singular value of ``G H^T``, at ``epsilon > 0`` the smallest ``(sigma_i + epsilon tau / sigma_i)^2`` (``P Q`` is
    ``M + 2 epsilon tau I + (epsilon tau)^2 M^-1`` with ``M = G^T G H^T H``), so never below ``4 epsilon tau`` even
    for a nearly rank-deficient head; finite for a head with ``G H^T = 0``."""
    gen = torch.Generator().manual_seed(0)
    G, H = torch.randn(4, 5, 2, generator=gen, dtype=torch.float64), torch.randn(4, 4, 2, generator=gen,
                                                                                dtype=torch.float64)
    G[3, :, 1] = G[3, :, 0] + 1e-4 * G[3, :, 1]  # nearly rank-deficient, the Gram floor still inactive
    H[2, :, :] = 0.0
    H[2, :, 0] = 1.0
    G[2, :, 0] = 0.0  # G H^T = 0 but neither factor is zero
    GtG, HtH = G.mT @ G, H.mT @ H
    assert torch.equal(pair_weights(GtG, HtH, "inv", 5, 4), torch.full((4,), 4.5, dtype=torch.float64))
    sigma = torch.linalg.svdvals(G @ H.mT)[:, :2]
    exact = pair_weights(GtG[:2], HtH[:2], "mix", 5, 4, epsilon=0.0)
    torch.testing.assert_close(exact, 4.5 / sigma[:2, -1].square(), rtol=1e-12, atol=0)
    epsilon = 1e-6
    w = pair_weights(GtG, HtH, "mix", 5, 4, epsilon=epsilon)
    tau = sigma.square().mean(-1)
    relaxed = (sigma + epsilon * tau[:, None] / sigma).square().amin(-1)
    torch.testing.assert_close(w[:2], 4.5 / relaxed[:2], rtol=1e-9, atol=0)
    torch.testing.assert_close(w[3], 4.5 / relaxed[3], rtol=1e-5, atol=0)  # its Gram condition is 1e8
    assert float(sigma[3, -1] / sigma[3, 0]) < 1e-4  # the relaxation holds the near-singular head's weight
    assert 4.5 / float(tau[3]) < float(w[3]) <= 4.5 / (4 * epsilon * float(tau[3]))
    assert float(w[3]) < 1e-3 * 4.5 / float(sigma[3, -1].square())  # unrelaxed, the weight would be 1e3 x larger
    assert bool(torch.isfinite(w[2])) and float(w[2]) > 0


def test_settings_check_and_carry_the_ball():
    settings = RunSettings(0.1, options=SpaceOptions("mix"))
    assert settings.config()["ball"] == "calibrated"
    assert RunSettings(0.1, options=SpaceOptions("inv", ball="paper")).config()["ball"] == "paper"
    with pytest.raises(ValueError, match="ball must be 'calibrated' or 'paper'"):
        RunSettings(0.1, options=SpaceOptions("inv", ball="adaptive"))  # type: ignore[arg-type]


def test_the_papers_ball_keeps_the_keys_of_settings_recorded_before_the_convention():
    """A stored result is keyed by its settings' dict: the paper's ball leaves ``ball`` out, so a key made before the
    convention existed (no ``ball``) is the paper's key; the calibrated ball is another key."""
    from hf_geosharp.leaderboard.run import fingerprint_settings
    from hf_geosharp.measures import Settings

    paper, calibrated = Settings(ball="paper"), Settings()
    before = {"rho": paper.rho, "mode": paper.mode, "steps": paper.steps, "n_samples": paper.n_samples,
              "seed": paper.seed, "epsilon": paper.epsilon, "adaptive_variant": paper.adaptive_variant}
    assert paper.as_dict() == before
    assert calibrated.as_dict() == {**before, "ball": "calibrated"}
    assert fingerprint_settings(paper) != fingerprint_settings(calibrated)
