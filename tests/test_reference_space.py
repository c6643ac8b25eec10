"""The fast perturbation space against the plain, dense :class:`ReferenceSpace` (float64, tiny BERT and a tiny
Llama whose RoPE blocks carry a Lie basis), and the precondition of the fast ascent direction, a g-self-adjoint
idempotent horizontal projection, as a checked property with negative controls."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.engine.space.reference_space import ReferenceSpace, projection_defects
from hf_geosharp.engine.space.workspace import Workspace
from hf_geosharp.symmetry import map_symmetries
from hf_geosharp.symmetry.base import PairBlock

from .fixtures.architectures import build
from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert

REL = 1e-10
MODELS = ("bert", "llama_gqa")  # llama_gqa: the qk blocks have the RoPE commutant as their Lie basis
#: (model, metric, epsilon, ball): every case under the default (calibrated) ball, the paper's ball at the default eps
CASES = [(name, metric, eps, "calibrated") for name in MODELS for metric in ("inv", "mix") for eps in (0.0, 1e-6, 1e-2)]
CASES += [(name, metric, 1e-6, "paper") for name in MODELS for metric in ("inv", "mix")]


@functools.cache
def _model(name: str) -> tuple[torch.Tensor, list[PairBlock]]:
    model = tiny_bert() if name == "bert" else build(name).model
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    blocks = map_symmetries(model).blocks
    in_pair = torch.zeros(theta.shape, dtype=torch.bool)
    for b in blocks:
        in_pair[b.G_index] = in_pair[b.H_index] = True
    theta[in_pair.logical_not().nonzero()[::997, 0]] = 0.0  # frozen elementwise coordinates (zero weights)
    return theta, blocks


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-eps{c[2]:g}-{c[3]}")
def spaces(request) -> tuple[PerturbationSpace, ReferenceSpace, torch.Tensor]:
    """The fast space (head by head in a 7-entry workspace when epsilon > 0) and the reference, same inputs."""
    name, metric, eps, ball = request.param
    theta, blocks = _model(name)
    options = SpaceOptions(metric, eps, ball=ball)
    workspace = Workspace(torch.float64, "cpu", 7) if eps else None
    fast = PerturbationSpace(theta, blocks, options, workspace=workspace)
    assert not eps or all(len(group.chunks) == group.g.shape[0] for group in fast.pairs)
    return fast, ReferenceSpace(theta, blocks, options), theta


def _draw(theta: torch.Tensor, seed: int) -> torch.Tensor:
    """A random vector of about the weights' size on every coordinate (frozen ones included), so that neither the
    elementwise nor the pair coordinates dominate the metric."""
    return torch.randn(theta.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * (
        theta.abs() + 1e-3
    )


def _regions(ref: ReferenceSpace) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair coordinates and the others. The metric is block-diagonal over the two and its scale differs between
    them by orders of magnitude (mix: about ``|w|^2`` on pairs against ``1/|w|^2`` elementwise), so every comparison
    is made region by region."""
    mask = torch.zeros(ref.numel, dtype=torch.bool)
    for head in ref.heads:
        mask[head.index] = True
    return mask, mask.logical_not()


def _assert_close(ref: ReferenceSpace, x: torch.Tensor, y: torch.Tensor, rel: float = REL) -> None:
    """``x`` equals the reference's ``y`` to ``rel`` on each region, in the metric and in the Euclidean norm (which
    also sees frozen coordinates)."""
    for region in _regions(ref):
        dx, yr = torch.where(region, x - y, 0.0), torch.where(region, y, 0.0)
        assert float(ref.norm(dx)) <= rel * float(ref.norm(yr))
        assert float(dx.norm()) <= rel * float(yr.norm())


def _scale(ref: ReferenceSpace, a: torch.Tensor, b: torch.Tensor) -> float:
    """The Cauchy-Schwarz bound of ``<a, b>_g`` summed region by region: the scale of its rounding error."""
    return sum(float(ref.norm(torch.where(r, a, 0.0)) * ref.norm(torch.where(r, b, 0.0))) for r in _regions(ref))


def _pairs_only(ref: ReferenceSpace, x: torch.Tensor) -> torch.Tensor:
    return torch.where(_regions(ref)[0], x, 0.0)


def _gradient(theta: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(theta.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_fixtures_cover_frozen_coordinates_and_lie_bases():
    for name in MODELS:
        theta, blocks = _model(name)
        assert (theta == 0).sum() >= 5  # frozen elementwise coordinates
        assert any(b.lie_basis is not None for b in blocks) == (name == "llama_gqa")


def test_inner_products_and_norms_match(spaces):
    fast, ref, theta = spaces
    a, b = _draw(theta, 0), _draw(theta, 1)
    for x, y in ((a, b), (_pairs_only(ref, a), _pairs_only(ref, b))):  # the pair metric alone, too
        assert _scale(ref, x, y) > 0
        assert abs(float(fast.inner_product(x, y)) - float(ref.inner_product(x, y))) <= REL * _scale(ref, x, y)
        assert float(fast.norm(x)) == pytest.approx(float(ref.norm(x)), rel=REL)


def test_riemannian_gradient_matches(spaces):
    fast, ref, theta = spaces
    egrad = _gradient(theta, 2)
    _assert_close(ref, fast.riemannian_gradient(egrad), ref.riemannian_gradient(egrad))


def test_horizontal_projection_matches_and_is_idempotent(spaces):
    fast, ref, theta = spaces
    x = _draw(theta, 3)
    h_fast, h_ref = fast.horizontal(x), ref.horizontal(x)
    _assert_close(ref, h_fast, h_ref)
    _assert_close(ref, fast.horizontal(h_fast), h_fast)
    _assert_close(ref, ref.horizontal(h_fast), h_fast)  # horizontal by the reference's own account
    x_pair = _pairs_only(ref, x)
    assert float(ref.norm(x_pair - _pairs_only(ref, h_ref))) > 1e-3 * float(ref.norm(x_pair))  # a vertical part
    rho = 0.5 * float(ref.norm(h_ref))
    _assert_close(ref, fast.project(x, rho), ref.project(x, rho))


def test_ascent_direction_matches_reference_inner_products(spaces):
    fast, ref, theta = spaces
    egrad = _gradient(theta, 4)
    vectors = torch.stack([fast.horizontal(_draw(theta, 5)), fast.horizontal(_pairs_only(ref, _draw(theta, 6)))])
    d_ref = ref.riemannian_gradient(egrad)
    e = egrad.clone()
    d, square, products = fast.ascent_direction(e, vectors, out=e)  # the gradient consumed in place
    _assert_close(ref, d, d_ref)
    assert square == pytest.approx(float(ref.inner_product(d_ref, d_ref)), rel=REL)
    for p, v in zip(products, vectors):
        assert abs(p - float(ref.inner_product(d_ref, v))) <= REL * _scale(ref, d_ref, v)
    d2, square2, products2 = ref.ascent_direction(egrad, vectors, out=torch.empty_like(egrad))
    assert torch.equal(d2, d_ref) and square2 == float(ref.inner_product(d_ref, d_ref))
    assert products2 == [float(ref.inner_product(d_ref, v)) for v in vectors]


@pytest.mark.parametrize("horizontal", [True, False])
def test_exp_point_and_pullback_match_autograd_of_the_reference(spaces, horizontal):
    """The point and the closed-form pullback of the fast space against ``Exp2`` from the Christoffel symbols of the
    dense metric field, and autograd through it."""
    fast, ref, theta = spaces
    xi = 0.5 * (fast.horizontal(_draw(theta, 7)) if horizontal else _draw(theta, 7))
    cotangent = _gradient(theta, 8)
    results = []
    for space in (fast, ref):
        point, grad = torch.empty_like(theta), cotangent.clone()
        space.exp_point(xi, point, True)(grad)
        results.append((point - theta - xi, grad - cotangent))  # the curvature term and its vector-Jacobian product
        again = torch.empty_like(theta)
        assert space.exp_point(xi, again, False) is None and torch.equal(again, point)
    (c_fast, g_fast), (c_ref, g_ref) = results
    assert float(c_ref.norm()) > 1e-3 * float(_pairs_only(ref, xi).norm())  # a curvature term that matters
    assert float((c_fast - c_ref).norm()) <= REL * float(c_ref.norm())
    assert float((g_fast - g_ref).norm()) <= REL * float(g_ref.norm())


def test_random_tangent_vectors_are_horizontal(spaces):
    fast, ref, _ = spaces
    z = fast.random_tangent_vector(torch.Generator().manual_seed(9))
    assert float(ref.norm(_pairs_only(ref, z))) > 0
    _assert_close(ref, ref.horizontal(z), z, rel=1e-9)


def test_horizontal_projection_is_g_self_adjoint_and_idempotent(spaces):
    """The precondition of the fast ascent direction, for both spaces (on whole vectors and on pair coordinates
    alone, where the metric is small in mix), and the identity it buys: ``<R e, v>_g = <e, v>`` for horizontal
    ``v``."""
    fast, ref, theta = spaces
    a, b = _draw(theta, 10), _draw(theta, 11)
    for x, y in ((a, b), (_pairs_only(ref, a), _pairs_only(ref, b))):
        for space in (fast, ref):
            self_adjoint, idempotent = projection_defects(space.inner_product, space.horizontal, x, y)
            assert self_adjoint < 1e-12 and idempotent < 1e-12
    egrad = _pairs_only(ref, _gradient(theta, 12))
    r, v = fast.riemannian_gradient(egrad), fast.horizontal(_pairs_only(ref, b))
    assert abs(float(fast.inner_product(r, v)) - float(egrad @ v)) <= REL * float(fast.norm(r) * fast.norm(v))


def test_the_self_adjointness_check_fails_for_an_oblique_projection():
    """Negative control: pairs measured elementwise (the ablation ``riemannian_norm=False``) keep the quotient
    metric's projection, which is idempotent but not self-adjoint in the measuring metric, and the identity
    ``<R e, v>_g = <e, v>`` breaks with it."""
    theta, blocks = _model("bert")
    space = PerturbationSpace(theta, blocks, SpaceOptions("inv", riemannian_norm=False))
    ref = ReferenceSpace(theta, blocks, SpaceOptions("inv", riemannian_norm=False))
    a, b = _pairs_only(ref, _draw(theta, 13)), _pairs_only(ref, _draw(theta, 14))
    self_adjoint, idempotent = projection_defects(space.inner_product, space.horizontal, a, b)
    assert self_adjoint > 1e-6 and idempotent < 1e-12  # passing projections: below 1e-16
    egrad = _pairs_only(ref, _gradient(theta, 15))
    r, v = space.riemannian_gradient(egrad), space.horizontal(b)
    assert abs(float(space.inner_product(r, v)) - float(egrad @ v)) > 1e-6 * float(space.norm(r) * space.norm(v))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_the_self_adjointness_check_fails_for_the_unrelaxed_projection(name, metric):
    """Negative control: measured with epsilon = 0.5 but projected with the unrelaxed metric's projection, the check
    fails and so does ``<R e, v>_g = <e, v>``; the projection of the measuring metric passes both."""
    theta, blocks = _model(name)
    relaxed = PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon=0.5))
    unrelaxed = PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon=0.0))
    raise_only = PerturbationSpace(theta, blocks, SpaceOptions(metric, epsilon=0.5, horizontal_projection=False))
    ref = ReferenceSpace(theta, blocks, SpaceOptions(metric, epsilon=0.5))
    a, b = _pairs_only(ref, _draw(theta, 16)), _pairs_only(ref, _draw(theta, 17))
    self_adjoint, idempotent = projection_defects(relaxed.inner_product, unrelaxed.horizontal, a, b)
    assert self_adjoint > 1e-6 and idempotent < 1e-12  # passing projections: below 1e-16
    assert max(projection_defects(relaxed.inner_product, relaxed.horizontal, a, b)) < 1e-12
    egrad = _pairs_only(ref, _gradient(theta, 18))
    raised = raise_only.riemannian_gradient(egrad)  # M^-1 e, not projected
    for project, holds in ((relaxed.horizontal, True), (unrelaxed.horizontal, False)):
        r, v = project(raised), project(b)
        defect = abs(float(relaxed.inner_product(r, v)) - float(egrad @ v)) / float(relaxed.norm(r) * relaxed.norm(v))
        assert (defect < REL) if holds else (defect > 1e-6)


def _ablations() -> list[tuple[str, SpaceOptions]]:
    return [
        ("mix-first-order", SpaceOptions("mix", 1e-6, second_order=False)),
        ("elementwise-norm", SpaceOptions("inv", 1e-6, riemannian_norm=False)),
        ("no-projection", SpaceOptions("mix", 1e-6, horizontal_projection=False)),
        ("curvature-second-order", SpaceOptions("inv", 1e-6, elementwise_curvature="second_order")),
        ("curvature-exact-exp", SpaceOptions("mix", 0.0, elementwise_curvature="exact_exp")),
        ("adaptive", SpaceOptions(None)),
        ("frozen-block", SpaceOptions("inv", 1e-6)),
    ]


@pytest.mark.parametrize("label, options", _ablations(), ids=[a[0] for a in _ablations()])
def test_ablations_and_frozen_blocks_match_the_reference(label, options):
    """Every switch of ``SpaceOptions``, and a block that a frozen coordinate sends to the elementwise metric."""
    theta, blocks = _model("bert")
    movable = None
    if label == "frozen-block":
        movable = torch.ones(theta.shape, dtype=torch.bool)
        movable[blocks[0].G_index[0, 0, 0]] = False
    fast = PerturbationSpace(theta, blocks, options, movable=movable, workspace=Workspace(torch.float64, "cpu", 7))
    ref = ReferenceSpace(theta, blocks, options, movable=movable)
    assert len(ref.heads) == fast.n_pairs == (0 if options.metric is None else 16 - 4 * (movable is not None))
    a, b, egrad = _draw(theta, 19), _draw(theta, 20), _draw(theta, 21) / (theta.abs() + 1e-3) ** 2
    assert abs(float(fast.inner_product(a, b)) - float(ref.inner_product(a, b))) <= REL * _scale(ref, a, b)
    _assert_close(ref, fast.horizontal(a), ref.horizontal(a))
    _assert_close(ref, fast.riemannian_gradient(egrad), ref.riemannian_gradient(egrad))
    vectors = fast.horizontal(b)[None]
    d, square, products = fast.ascent_direction(egrad.clone(), vectors, out=torch.empty_like(theta))
    d_ref, square_ref, products_ref = ref.ascent_direction(egrad, vectors, out=torch.empty_like(theta))
    _assert_close(ref, d, d_ref)
    assert square == pytest.approx(square_ref, rel=REL)
    assert abs(products[0] - products_ref[0]) <= REL * _scale(ref, d_ref, vectors[0])
    xi = 0.3 * fast.horizontal(a)
    cotangent = torch.randn(theta.shape, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    nonlinear = options.elementwise_curvature != "none" or (options.second_order and options.metric is not None)
    results = []
    for space in (fast, ref):
        point, grad = torch.empty_like(theta), cotangent.clone()
        pullback = space.exp_point(xi, point, True)
        assert (pullback is not None) == nonlinear
        if pullback is not None:
            pullback(grad)
        assert nonlinear or (torch.equal(point, theta + xi) and torch.equal(grad, cotangent))
        results.append((point - theta - xi, grad - cotangent))
    (c_fast, g_fast), (c_ref, g_ref) = results
    if nonlinear:
        assert float((c_fast - c_ref).norm()) <= REL * float(c_ref.norm())
        assert float((g_fast - g_ref).norm()) <= REL * float(g_ref.norm())
