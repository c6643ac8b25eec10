"""The quotient geometry against the mathematical properties of docs/spec.md §9 (float64, tiny shapes)."""

import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
import torch

from hf_geosharp.engine.geometry.elementwise import ElementwiseGeometry
from hf_geosharp.engine.geometry.gl_quotient import GLQuotient, gl_quotient

K, N, M, H = 3, 7, 5, 3
METRICS = ["inv", "mix"]


def _pair(seed=0, k=K, n=N, m=M, h=H):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(k, n, h, generator=g, dtype=torch.float64), torch.randn(k, m, h, generator=g, dtype=torch.float64)
    )


def _random_group_element(seed=1, k=K, h=H, condition=10.0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(k, h, h, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(k, h, h, generator=g, dtype=torch.float64))
    s = torch.logspace(0, np.log10(condition), h, dtype=torch.float64)
    return U @ torch.diag_embed(s.expand(k, h)) @ V.mT


def _act(A, pair):
    return pair[0] @ torch.linalg.inv(A), pair[1] @ A.mT


def _full_basis(h=H):
    return torch.eye(h * h, dtype=torch.float64).reshape(h * h, h, h)


@pytest.fixture(params=METRICS)
def metric(request):
    return request.param


def test_projection_is_orthogonal_to_vertical_space_and_idempotent(metric):
    G, Hm = _pair()
    geo = gl_quotient(G, Hm, metric, epsilon=0.0)
    xi = _pair(seed=5)
    p = geo.projection(xi)
    for seed in range(3):
        Lam = torch.randn(K, H, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        v = geo.vertical_vector(Lam)
        assert geo.inner_product(p, v).abs().max() < 1e-11
        assert geo.inner_product(xi, v).abs().max() > 1e-3  # the test would notice a no-op projection
    pp = geo.projection(p)
    assert torch.allclose(pp[0], p[0], atol=1e-12) and torch.allclose(pp[1], p[1], atol=1e-12)


def test_paper_literal_inv_projection_is_not_horizontal():
    """The printed `A Lam + Lam A^T = B` fails (docs/spec.md §1.5): our corrected solve is the one that works."""
    G, Hm = _pair()
    geo = gl_quotient(G, Hm, "inv", epsilon=0.0)
    xi = _pair(seed=5)
    P, Q = (G.mT @ G), (Hm.mT @ Hm)
    A = (P @ Q)[0].numpy()
    B = (P @ Hm.mT @ xi[1] - xi[0].mT @ G @ Q)[0].numpy()
    lam_literal = torch.from_numpy(scipy.linalg.solve_sylvester(A, A.T, B))
    lam = geo._projection_lambda(xi)[0]
    assert torch.allclose(lam.mT, torch.from_numpy(scipy.linalg.solve_sylvester(A, A, B)), atol=1e-10)
    wrong = (xi[0][0] + G[0] @ lam_literal, xi[1][0] - Hm[0] @ lam_literal.mT)
    one = gl_quotient(G[:1], Hm[:1], "inv", epsilon=0.0)
    v = one.vertical_vector(torch.randn(1, H, H, dtype=torch.float64))
    assert one.inner_product((wrong[0][None], wrong[1][None]), v).abs().max() > 1e-6


def test_reduced_group_with_full_basis_matches_closed_form(metric):
    G, Hm = _pair()
    full = gl_quotient(G, Hm, metric, epsilon=1e-3)
    reduced = gl_quotient(G, Hm, metric, epsilon=1e-3, lie_basis=_full_basis())
    xi = _pair(seed=9)
    a, b = full.projection(xi), reduced.projection(xi)
    assert torch.allclose(a[0], b[0], atol=1e-10) and torch.allclose(a[1], b[1], atol=1e-10)


def test_reduced_group_projection_is_orthogonal_to_its_vertical_space(metric):
    basis = _full_basis()[[0, 4, 8]]  # diagonal subgroup: per-column rescaling
    G, Hm = _pair()
    geo = gl_quotient(G, Hm, metric, epsilon=0.0, lie_basis=basis)
    p = geo.projection(_pair(seed=2))
    for E in basis:
        assert geo.inner_product(p, geo.vertical_vector(E.expand(K, H, H))).abs().max() < 1e-11


def test_metric_invariance_and_projection_equivariance(metric):
    G, Hm = _pair()
    A = _random_group_element()
    geo, geo_A = gl_quotient(G, Hm, metric, 0.0), gl_quotient(*_act(A, (G, Hm)), metric, 0.0)
    a, b = _pair(seed=3), _pair(seed=4)
    assert torch.allclose(geo.inner_product(a, b), geo_A.inner_product(_act(A, a), _act(A, b)), rtol=1e-10)
    pa = _act(A, geo.projection(a))
    pa_A = geo_A.projection(_act(A, a))
    assert torch.allclose(pa[0], pa_A[0], atol=1e-9) and torch.allclose(pa[1], pa_A[1], atol=1e-9)


def test_riemannian_gradient_represents_the_euclidean_gradient(metric):
    G, Hm = _pair()
    geo = gl_quotient(G, Hm, metric, 0.0)
    e, eta = _pair(seed=6), _pair(seed=7)
    r = geo.euclidean_to_riemannian_gradient(e)
    frob = (e[0] * eta[0]).sum((-2, -1)) + (e[1] * eta[1]).sum((-2, -1))
    assert torch.allclose(geo.inner_product(r, eta), frob, rtol=1e-10)


def test_exp2_is_equivariant(metric):
    G, Hm = _pair()
    A = _random_group_element(condition=100.0)
    geo, geo_A = gl_quotient(G, Hm, metric, 0.0), gl_quotient(*_act(A, (G, Hm)), metric, 0.0)
    xi = geo.projection(_pair(seed=8))
    w1 = geo.exp2(xi)
    w2 = geo_A.exp2(_act(A, xi))
    assert torch.allclose(w1[0] @ w1[1].mT, w2[0] @ w2[1].mT, atol=1e-9)


def _geodesic_ode(G, Hm, xi, metric, t):
    """Integrate the geodesic equation x'' = -Gamma_x(x', x') (DOP853) for one pair."""
    shapes = [G.shape, Hm.shape]
    sizes = [G.numel(), Hm.numel()]

    def rhs(_, y):
        pos = torch.from_numpy(y[: sum(sizes)])
        vel = torch.from_numpy(y[sum(sizes) :])
        g = pos[: sizes[0]].view(shapes[0]), pos[sizes[0] :].view(shapes[1])
        v = vel[: sizes[0]].view(shapes[0]), vel[sizes[0] :].view(shapes[1])
        cG, cH = gl_quotient(g[0], g[1], metric, 0.0).exp2_correction(v)  # = -Gamma/2
        return np.concatenate([vel.numpy(), 2 * cG.reshape(-1).numpy(), 2 * cH.reshape(-1).numpy()])

    y0 = np.concatenate([G.reshape(-1), Hm.reshape(-1), xi[0].reshape(-1), xi[1].reshape(-1)])
    sol = scipy.integrate.solve_ivp(rhs, (0, t), y0, method="DOP853", rtol=1e-12, atol=1e-12)
    y = torch.from_numpy(sol.y[: sum(sizes), -1])
    return y[: sizes[0]].view(shapes[0]), y[sizes[0] :].view(shapes[1])


def test_second_order_geodesic_error_is_cubic(metric):
    G, Hm = _pair(k=1)
    geo = gl_quotient(G, Hm, metric, 0.0)
    xi = geo.projection(_pair(seed=11, k=1))
    scale = 0.3 / float(geo.norm(xi).max())
    errors_2, errors_1 = [], []
    for t in (1.0, 0.5, 0.25):
        v = (xi[0] * scale * t, xi[1] * scale * t)
        exact = _geodesic_ode(G, Hm, v, metric, 1.0)
        second = geo.exp2(v)
        errors_2.append(float(torch.cat([(second[i] - exact[i]).reshape(-1) for i in range(2)]).norm()))
        first = [(G + v[0] - exact[0]).reshape(-1), (Hm + v[1] - exact[1]).reshape(-1)]
        errors_1.append(float(torch.cat(first).norm()))
    ratios_2 = [errors_2[i] / errors_2[i + 1] for i in range(2)]
    ratios_1 = [errors_1[i] / errors_1[i + 1] for i in range(2)]
    assert all(6.5 < r < 9.5 for r in ratios_2), ratios_2  # O(t^3)
    assert all(3.2 < r < 4.8 for r in ratios_1), ratios_1  # first order is only O(t^2)


def test_sampler_has_metric_isotropic_covariance(metric):
    G, Hm = _pair(k=1, n=4, m=4, h=2)
    geo = gl_quotient(G, Hm, metric, 0.0, probe_generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    zs = torch.cat([geo.random_tangent_vector(gen)[0].reshape(-1, 2) for _ in range(6000)])
    cov = zs.mT @ zs / zs.shape[0]
    target = (G.mT @ G)[0] if metric == "inv" else torch.linalg.inv(Hm.mT @ Hm)[0]
    assert torch.allclose(cov, target, rtol=0.06, atol=0.03 * float(target.abs().max()))


def test_sampler_is_equivariant(metric):
    G, Hm = _pair()
    A = _random_group_element(condition=100.0)
    geo = gl_quotient(G, Hm, metric, 0.0, probe_generator=torch.Generator().manual_seed(0))
    geo_A = gl_quotient(*_act(A, (G, Hm)), metric, 0.0, probe_generator=torch.Generator().manual_seed(0))
    z = geo.random_tangent_vector(torch.Generator().manual_seed(3))
    z_A = geo_A.random_tangent_vector(torch.Generator().manual_seed(3))
    expected = _act(A, z)
    assert torch.allclose(z_A[0], expected[0], atol=1e-8) and torch.allclose(z_A[1], expected[1], atol=1e-8)


def test_singular_head_without_epsilon_gives_clear_error():
    G, Hm = _pair()
    G[0, :, 0] = 0.0
    with pytest.raises(ValueError, match="epsilon"):
        gl_quotient(G, Hm, "inv", epsilon=0.0)
    geo = gl_quotient(G, Hm, "inv", epsilon=1e-6)  # the relaxation keeps it finite
    assert torch.isfinite(geo.projection(_pair(seed=2))[0]).all()


def test_elementwise_geometry_matches_adaptive_sharpness_conventions():
    w = torch.tensor([2.0, -0.5, 0.0, 1.0], dtype=torch.float64)
    geo = ElementwiseGeometry(w, curvature="exact_exp")
    xi = torch.tensor([0.2, 0.1, 0.3, -0.1], dtype=torch.float64)
    assert torch.isclose(geo.norm(xi), torch.tensor([0.1, 0.2, 0.0, 0.1], dtype=torch.float64).norm())
    assert geo.projection(xi)[2] == 0  # zero weights never move
    moved = w + geo.projection(xi) + geo.exp_correction(geo.projection(xi))
    exact = torch.where(w != 0, w * torch.exp(geo.projection(xi) / torch.where(w != 0, w, 1)), w)
    assert torch.allclose(moved, exact)
    second = ElementwiseGeometry(w, curvature="second_order").exp_correction(xi)
    assert torch.allclose(second[[0, 1, 3]], (xi**2 / (2 * w))[[0, 1, 3]])


# ---------------------------------------------------------------------- the covariant relaxation (epsilon > 0)
EPS = 1e-2  # large, so that an O(epsilon) defect of the projection or of the invariance would show


def _singular_pair(seed=0):
    """Head 0 has a dead column of G, head 1 a dead column of H: only the relaxation keeps them finite."""
    G, Hm = _pair(seed)
    G[0, :, 0] = 0.0
    Hm[1, :, 2] = 0.0
    return G, Hm


@pytest.mark.parametrize("singular", [False, True])
def test_relaxed_projection_is_exact_idempotent_and_orthogonal(metric, singular):
    G, Hm = _singular_pair() if singular else _pair()
    geo = gl_quotient(G, Hm, metric, epsilon=EPS)
    xi = _pair(seed=5)
    p = geo.projection(xi)
    for seed in range(3):
        lam = torch.randn(K, H, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        v = geo.vertical_vector(lam)
        scale = float(geo.norm(p).max() * geo.norm(v).max())
        assert geo.inner_product(p, v).abs().max() < 1e-11 * scale
        assert geo.inner_product(xi, v).abs().max() > 1e-3 * scale
    pp = geo.projection(p)
    assert torch.allclose(pp[0], p[0], atol=1e-11) and torch.allclose(pp[1], p[1], atol=1e-11)


def test_relaxed_projection_matches_a_dense_least_squares_reference(metric):
    """Slow reference: minimise ||xi + vertical(Lam)||_g over Lam by a dense solve of the normal equations."""
    G, Hm = _pair(k=1)
    geo = gl_quotient(G, Hm, metric, epsilon=EPS)
    xi = _pair(seed=3, k=1)
    basis = _full_basis()
    V = [geo.vertical_vector(E[None]) for E in basis]
    gram = torch.stack([torch.stack([geo.inner_product(a, b)[0] for b in V]) for a in V])
    rhs = torch.stack([geo.inner_product(xi, a)[0] for a in V])
    coef = torch.linalg.solve(gram, -rhs)
    lam = torch.einsum("b,bij->ij", coef, basis)[None]
    assert torch.allclose(geo._projection_lambda(xi), lam, atol=1e-10)


def _covariance_checks(geo, geo_A, A, G, Hm, sampler=True):
    a, b = _pair(seed=3), _pair(seed=4)
    assert torch.allclose(geo.inner_product(a, b), geo_A.inner_product(_act(A, a), _act(A, b)), rtol=1e-9)
    pa, pa_A = _act(A, geo.projection(a)), geo_A.projection(_act(A, a))
    assert torch.allclose(pa[0], pa_A[0], atol=1e-8) and torch.allclose(pa[1], pa_A[1], atol=1e-8)
    xi = geo.projection(_pair(seed=8))
    w1, w2 = geo.exp2(xi), geo_A.exp2(_act(A, xi))
    assert torch.allclose(w1[0] @ w1[1].mT, w2[0] @ w2[1].mT, atol=1e-8)
    if sampler:  # the probe root needs full-rank factors
        z = geo.random_tangent_vector(torch.Generator().manual_seed(0))
        z_A, expected = geo_A.random_tangent_vector(torch.Generator().manual_seed(0)), _act(A, z)
        assert torch.allclose(z_A[0], expected[0], atol=1e-7) and torch.allclose(z_A[1], expected[1], atol=1e-7)


def test_relaxed_metric_projection_exp2_and_sampler_are_covariant(metric):
    """General GL(h) elements: exact while both Gram matrices have condition number <= 1/epsilon."""
    G, Hm = _pair()
    A = 10.0 * _random_group_element(condition=10.0)
    probe = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    geo = gl_quotient(G, Hm, metric, 1e-3, probe_generator=probe())
    geo_A = gl_quotient(*_act(A, (G, Hm)), metric, 1e-3, probe_generator=probe())
    assert (geo._P64 - G.mT @ G).norm() > 1e-5 * (G.mT @ G).norm()  # the relaxation is really there
    _covariance_checks(geo, geo_A, A, G, Hm)


def test_relaxation_of_singular_heads_is_covariant_under_per_head_rescaling(metric):
    G, Hm = _singular_pair()
    c = torch.tensor([1e-2, 3.0, 1e2], dtype=torch.float64)
    A = c[:, None, None] * torch.eye(H, dtype=torch.float64)
    geo, geo_A = gl_quotient(G, Hm, metric, EPS), gl_quotient(*_act(A, (G, Hm)), metric, EPS)
    _covariance_checks(geo, geo_A, A, G, Hm, sampler=False)


def test_relaxation_is_relative_and_the_old_absolute_one_is_not_invariant():
    """Per-head rescaling A = c I leaves the relaxed metric exactly invariant, for c from 1e-2 to 1e2; the absolute
    relaxation G^T G + eps I (the former default) is not, which is the defect the relative one removes."""
    G, Hm = _pair()
    a, b = _pair(seed=3), _pair(seed=4)
    ref = gl_quotient(G, Hm, "inv", 1e-6).inner_product(a, b)
    for c in (1e-2, 1e2):
        A = c * torch.eye(H, dtype=torch.float64).expand(K, H, H)
        moved = gl_quotient(*_act(A, (G, Hm)), "inv", 1e-6).inner_product(_act(A, a), _act(A, b))
        assert torch.allclose(moved, ref, rtol=1e-12)
    P, Q = GLQuotient.relaxed_grams(G.mT @ G, Hm.mT @ Hm, 1e-6)
    rel = (P - G.mT @ G).norm() / (G.mT @ G).norm()
    assert 1e-8 < rel < 1e-5  # relative to the spectrum: about epsilon
    Gs = G * 1e-3
    absolute = (Gs.mT @ Gs + 1e-6 * torch.eye(H)) - Gs.mT @ Gs
    assert absolute.norm() / (Gs.mT @ Gs).norm() > 1e-3  # the absolute relaxation is 1e5 x larger here


def test_reduced_group_relaxed_projection_is_orthogonal(metric):
    basis = _full_basis()[[0, 4, 8]]
    G, Hm = _singular_pair()
    geo = gl_quotient(G, Hm, metric, epsilon=EPS, lie_basis=basis)
    full = gl_quotient(G, Hm, metric, epsilon=EPS, lie_basis=_full_basis())
    closed = gl_quotient(G, Hm, metric, epsilon=EPS)
    xi = _pair(seed=2)
    p = geo.projection(xi)
    for E in basis:
        assert geo.inner_product(p, geo.vertical_vector(E.expand(K, H, H))).abs().max() < 1e-10
    a, b = full.projection(xi), closed.projection(xi)
    # Two backward-stable solvers of the same linear system agree to O(unit roundoff * condition number); the dead
    # columns make the relaxed Gram matrices ill-conditioned (about 1e8 here), so the tolerance scales with it.
    cond = max(float(torch.linalg.cond(closed._P64).max()), float(torch.linalg.cond(closed._Q64).max()))
    tol = max(1e-9, 1e-13 * cond)
    assert torch.allclose(a[0], b[0], atol=tol) and torch.allclose(a[1], b[1], atol=tol)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_closed_form_exp2_pullback_matches_autograd(metric):
    g = torch.Generator().manual_seed(0)
    pair = lambda: (torch.randn(3, 7, 4, generator=g, dtype=torch.float64),  # noqa: E731
                    torch.randn(3, 5, 4, generator=g, dtype=torch.float64))
    geo = gl_quotient(*pair(), metric, epsilon=1e-3)
    xi, cot = pair(), pair()
    leaves = tuple(x.clone().requires_grad_(True) for x in xi)
    reference = geo.exp2_correction(leaves)
    expected = torch.autograd.grad(reference, leaves, cot)
    fast, pullback = geo.exp2_correction_with_pullback(xi)
    for a, b in zip(fast, reference):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(pullback(cot, xi), expected):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
