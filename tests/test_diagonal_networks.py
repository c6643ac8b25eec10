"""The diagonal-network reproduction: exact-geodesic geometry (docs/spec.md §2.5), closed forms,
 training, statistics, CLI."""

import json
import math

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch

from experiments import diagonal_networks as dn
from experiments import exact_geodesic

D = 6
CASES = [("inv", "metric"), ("mix", "metric"), ("mix", "loose"), ("inv", "loose")]


def _point(seed=0, d=D):
    """Weights bounded away from 0, with both signs."""
    g = torch.Generator().manual_seed(seed)

    def draw():
        magnitude = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
        return magnitude * torch.randn(d, generator=g, dtype=torch.float64).sign()

    return draw(), draw()


def _rand(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("metric, constraint", CASES)
def test_projection_is_the_metric_orthogonal_projection_onto_the_horizontal_space(metric, constraint):
    space = exact_geodesic.ExactGeodesicSpace(*_point(), metric, constraint)
    xi = _rand(2 * D, 1)
    p = space.horizontal(xi)
    p_u, p_v = space.split(p)
    assert torch.allclose(p_u / space.u, p_v / space.v, atol=1e-13)  # horizontal: xi_u / u = xi_v / v
    for seed in range(3):
        vertical = space.vertical_vector(_rand(D, 10 + seed))
        assert abs(float(space.inner_product(p, vertical))) < 1e-12
        assert abs(float(space.inner_product(xi, vertical))) > 1e-3  # a no-op projection would fail above
    r_u, r_v = space.split(xi - p)
    assert torch.allclose(r_u / space.u, -r_v / space.v, atol=1e-12)  # what was removed is vertical
    assert torch.allclose(space.horizontal(p), p, atol=1e-14)


@pytest.mark.parametrize("metric, constraint", CASES)
def test_riemannian_gradient_is_horizontal_and_represents_the_differential(metric, constraint):
    space = exact_geodesic.ExactGeodesicSpace(*_point(1), metric, constraint)
    egrad = _rand(2 * D, 2)
    r = space.riemannian_gradient(egrad)
    assert torch.allclose(space.horizontal(r), r, atol=1e-13)
    eta = space.horizontal(_rand(2 * D, 3))
    # <grad f, eta>_g = df(eta) for every horizontal eta: the defining property the solver relies on.
    assert float(space.inner_product(r, eta)) == pytest.approx(float(egrad @ eta), rel=1e-12)
    # The solver's step reads these through ascent_direction, also when it consumes the gradient in place.
    d, square, (product,) = space.ascent_direction(egrad.clone(), eta[None], out=torch.empty_like(egrad))
    assert torch.allclose(d, r, atol=1e-14)
    assert square == pytest.approx(float(space.inner_product(r, r)), rel=1e-12)
    assert product == pytest.approx(float(space.inner_product(r, eta)), rel=1e-12)
    consumed = egrad.clone()
    d, square, (product,) = space.ascent_direction(consumed, eta[None], out=consumed)
    assert d is consumed and torch.allclose(d, r, atol=1e-14)
    assert product == pytest.approx(float(space.inner_product(r, eta)), rel=1e-12)


@pytest.mark.parametrize("metric, constraint", CASES)
def test_random_tangent_vectors_are_horizontal_and_metric_isotropic(metric, constraint):
    """Projecting N(0, g^-1) onto the d-dimensional horizontal space gives E ||xi||_g^2 = d."""
    space = exact_geodesic.ExactGeodesicSpace(*_point(5), metric, constraint)
    g = torch.Generator().manual_seed(0)
    samples = torch.stack([space.random_tangent_vector(g) for _ in range(4000)])
    assert torch.allclose(torch.stack([space.horizontal(x) for x in samples[:10]]), samples[:10], atol=1e-13)
    mean_sq = float(torch.stack([space.norm(x) ** 2 for x in samples]).mean())
    assert mean_sq == pytest.approx(D, rel=0.03)


def test_norm_identities_of_the_diagonal_network_metrics():
    u, v = _point(2)
    b = _rand(D, 4)
    for metric, constraint, expected in [
        ("inv", "metric", math.sqrt(2) * b.norm()),
        ("mix", "metric", math.sqrt(2) * (b * u * v).norm()),
        ("mix", "loose", b.norm()),
    ]:
        space = exact_geodesic.ExactGeodesicSpace(u, v, metric, constraint)
        xi = space.horizontal_vector(b)
        assert float(space.norm(xi)) == pytest.approx(float(expected), rel=1e-13)
        assert torch.allclose(space.b_of(xi), b, atol=1e-14)


def _geodesic_ode(metric):
    """Euler-Lagrange equations of the energy, per coordinate, written out by hand.

    inv: L = u'^2/u^2 + v'^2/v^2 gives u'' = u'^2/u (same for v).
    mix: L = v^2 u'^2 + u^2 v'^2 gives u'' = (u v'^2 - 2 v u' v')/v^2 and v'' = (v u'^2 - 2 u u' v')/u^2."""

    def rhs(_, y):
        u, v, du, dv = np.split(y, 4)
        if metric == "inv":
            ddu, ddv = du**2 / u, dv**2 / v
        else:
            ddu = (u * dv**2 - 2 * v * du * dv) / v**2
            ddv = (v * du**2 - 2 * u * du * dv) / u**2
        return np.concatenate([du, dv, ddu, ddv])

    return rhs


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_exact_geodesics_match_an_ode_integration_and_the_closed_forms(metric):
    u, v = _point(3)
    space = exact_geodesic.ExactGeodesicSpace(u, v, metric)
    b = 0.3 * _rand(D, 5).clamp(-1.2, 1.2)  # 1 + 2b > 0: the mix geodesic exists up to t = 1
    xi = space.horizontal_vector(b)
    xi_u, xi_v = space.split(xi)
    y0 = np.concatenate([u.numpy(), v.numpy(), xi_u.numpy(), xi_v.numpy()])
    ts = [0.25, 0.5, 1.0]
    sol = scipy.integrate.solve_ivp(_geodesic_ode(metric), (0, 1), y0, method="DOP853", rtol=1e-12, atol=1e-13,
                                    t_eval=ts, dense_output=True)
    speed0 = float(space.norm(xi))
    for k, t in enumerate(ts):
        u_t, v_t = space.geodesic(xi, t)
        assert np.allclose(sol.y[:D, k], u_t.numpy(), rtol=1e-9, atol=1e-11)
        assert np.allclose(sol.y[D : 2 * D, k], v_t.numpy(), rtol=1e-9, atol=1e-11)
        # along the geodesic the velocity stays horizontal and its speed (metric at the current point) is constant
        du, dv = sol.y[2 * D : 3 * D, k], sol.y[3 * D :, k]
        assert np.allclose(du / sol.y[:D, k], dv / sol.y[D : 2 * D, k], atol=1e-9)
        moving = exact_geodesic.ExactGeodesicSpace(u_t, v_t, metric)
        assert float(moving.norm(torch.tensor(np.concatenate([du, dv])))) == pytest.approx(speed0, rel=1e-9)
    beta1 = u * v * (torch.exp(2 * b) if metric == "inv" else 1 + 2 * b)
    u1, v1 = space.geodesic(xi)
    assert torch.allclose(u1 * v1, beta1, rtol=1e-13) and torch.allclose(space.endpoint_beta(xi), beta1, rtol=1e-13)


def _orthonormal_problem(d, n, beta_star, seed=0):
    """X with X^T X / n = I, so the MSE is ||beta - beta*||^2 (+ 0: the labels are noiseless)."""
    q, _ = torch.linalg.qr(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    X = q * math.sqrt(n)
    return dn.Problem(X, X @ beta_star, beta_star)


@pytest.mark.parametrize("rho", [0.01, 0.1, 0.5])
def test_mix_sharpness_matches_its_closed_form_when_the_gram_matrix_is_the_identity(rho):
    """docs/spec.md §2.5 (derived): S_mix = 2 sqrt(2) rho ||beta0 - beta*|| + 2 rho^2, for the loss ||X beta - y||^2
    with X^T X = I (here: the MSE with X^T X = n I). It holds while no geodesic is cut at beta_i = 0."""
    u, v = _point(4, d=8)
    beta_star = _rand(8, 6)
    problem = _orthonormal_problem(8, 16, beta_star)
    value, cut = exact_geodesic.geodesic_sharpness(u, v, problem, metric="mix", constraint="metric", rho=rho, steps=20)
    closed = 2 * math.sqrt(2) * rho * float((u * v - beta_star).norm()) + 2 * rho**2
    assert cut == 0
    assert value == pytest.approx(closed, rel=1e-10)


def test_mix_geodesic_cannot_flip_the_sign_of_beta_so_the_closed_form_can_overestimate():
    """d = 1, beta0 = 0.1, beta* = 1, rho = 0.5: the closed form's maximiser beta0 - sqrt(2) rho = -0.61 lies beyond the
    end of the mix geodesic (beta = 0 at b = -1/2), so the exact value is max over [0, 0.81] of (beta - 1)^2 - 0.81."""
    problem = _orthonormal_problem(1, 4, torch.tensor([1.0], dtype=torch.float64))
    u, v = torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    value, cut = exact_geodesic.geodesic_sharpness(u, v, problem, metric="mix", constraint="metric", rho=0.5, steps=20)
    closed = 2 * math.sqrt(2) * 0.5 * 0.9 + 2 * 0.5**2
    assert cut == 1
    assert value == pytest.approx(1.0 - 0.81, rel=1e-12)
    assert value < closed / 5


def test_batched_training_matches_plain_autograd_gradient_descent_net_by_net():
    problem = dn.make_problem(20, 10, 3, "signed", seed=0)
    alpha, lr = dn.sample_hyperparameters(3, (0.05, 0.5), (0.02, 0.08), seed=0)
    nets = dn.train_gd(problem, *dn.initial_weights(alpha, 20, "reference"), lr, target_loss=1e-3, max_steps=100_000)
    assert bool(nets.converged.all()) and len(set(nets.steps.tolist())) == 3  # the nets stop at different steps
    for i in range(3):
        u = torch.full((20,), float(alpha[i]), dtype=torch.float64, requires_grad=True)
        v = torch.zeros(20, dtype=torch.float64, requires_grad=True)
        for _ in range(int(nets.steps[i])):
            loss = (problem.X @ (u * v) - problem.y).square().mean()
            gu, gv = torch.autograd.grad(loss, (u, v))
            with torch.no_grad():
                u -= lr[i] * gu
                v -= lr[i] * gv
        assert torch.allclose(nets.u[i], u.detach(), rtol=1e-9, atol=1e-12)
        assert torch.allclose(nets.v[i], v.detach(), rtol=1e-9, atol=1e-12)
        assert float(nets.train_loss[i]) <= 1e-3 < loss.item()  # the last step is the first to reach the target
    # GD multiplies u^2 - v^2 by (1 - lr^2 g^2) each step: it shrinks from alpha^2 but stays positive
    ratio = (nets.u.square() - nets.v.square()) / alpha[:, None] ** 2
    assert bool((ratio > 0).all()) and bool((ratio <= 1 + 1e-12).all())
    balanced = dn.train_gd(problem, *dn.initial_weights(alpha, 20, "balanced"), lr, target_loss=1e-6, max_steps=2000)
    assert torch.equal(balanced.u, balanced.v)  # GD keeps u = v exactly, so beta = u^2 >= 0 whatever beta* is
    assert bool((balanced.beta >= 0).all()) and bool((problem.beta_star < 0).any())


def test_a_diverging_net_is_flagged_not_kept_running():
    problem = dn.make_problem(20, 10, 2, "signed", seed=0)
    u0, v0 = dn.initial_weights(torch.tensor([0.1, 3.0], dtype=torch.float64), 20, "reference")
    lr = torch.tensor([0.05, 5.0], dtype=torch.float64)
    nets = dn.train_gd(problem, u0, v0, lr, target_loss=1e-6, max_steps=50_000)
    assert nets.converged.tolist() == [True, False]
    assert int(nets.steps[1]) < 1000


def test_vectorised_bootstrap_tau_equals_scipy_on_every_resample():
    rng = np.random.default_rng(0)
    x, y = rng.random(30), rng.random(30)
    y[:10] += 2 * x[:10]
    x[3] = x[4]  # a tie in the data as well
    counts = rng.multinomial(30, np.full(30, 1 / 30), size=200)
    fast = dn.bootstrap_kendall(x, y, counts.astype(float))
    resamples = [np.repeat(np.arange(30), c) for c in counts]
    slow = [scipy.stats.kendalltau(x[i], y[i]).statistic for i in resamples]
    assert np.allclose(fast, slow, atol=1e-14)
    summary = dn.kendall(x, y, n_boot=500, seed=0)
    assert summary["tau"] == pytest.approx(scipy.stats.kendalltau(x, y).statistic)
    assert summary["ci95"][0] < summary["tau"] < summary["ci95"][1]


def test_end_to_end_small_run_writes_json_and_figure(tmp_path):
    argv = [
        "--n-nets", "6", "--dim", "20", "--n-train", "10", "--nonzeros", "2", "--out", str(tmp_path),
        "--alpha-range", "0.05", "0.5", "--lr-range", "0.02", "0.05", "--target-loss", "1e-4", "--max-steps", "20000",
        "--bootstrap", "100", "--converged-steps", "30", "--rho-grid", "0.05", "--data-seeds", "1",
    ]
    report = dn.run(dn.build_parser().parse_args(argv))
    on_disk = json.loads((tmp_path / "diagonal_networks.json").read_text())
    assert (tmp_path / "diagonal_networks.png").stat().st_size > 10_000
    assert on_disk["main"]["tau"].keys() == report["main"]["tau"].keys()
    assert set(on_disk["main"]["tau"]) == {*dn.SHARPNESS_MEASURES, *dn.TRIVIAL_PREDICTORS}
    assert set(on_disk["paper_tau"]) == {"adaptive", "geodesic_inv", "geodesic_mix"}
    assert len(on_disk["main"]["models"]) == 6
    model = on_disk["main"]["models"][0]
    assert {"alpha", "lr", "steps", "converged", "test_loss", *dn.SHARPNESS_MEASURES, "mix_cut_metric"} <= set(model)
    for t in on_disk["main"]["tau"].values():
        assert -1 <= t["tau"] <= 1 and t["ci95"][0] <= t["ci95"][1]
    converged = [m for m in on_disk["main"]["models"] if m["converged"]]
    assert converged and all(m["adaptive"] > 0 and m["geodesic_inv"] > 0 for m in converged)
    sweeps = on_disk["sweeps"]
    assert [row["label"] for row in sweeps["switches"]][:3] == ["main", "adaptive 30 steps", "geodesic 30 steps"]
    assert [row["label"] for row in sweeps["rho"]] == ["rho 0.05"]
    assert [row["label"] for row in sweeps["data_seed"]] == ["data seed 0", "data seed 1"]
    assert set(sweeps["solver_convergence"]) == set(dn.SHARPNESS_MEASURES)
    assert on_disk["runtime_s"] > 0
