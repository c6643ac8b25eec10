"""The perturbation space's fast paths against their slow references: strided gathers and scatters vs index
operations, the solver's step direction and Gram row vs metric inner products, pair temporaries carved from idle
buffers vs fresh ones."""

from __future__ import annotations

import pytest
import torch

from hf_geosharp.space import Factor, PerturbationSpace, SpaceOptions, _stack_alike
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert


def test_strided_gathers_and_scatters_match_index_operations():
    model = tiny_bert()
    smap = map_symmetries(model)
    x = torch.randn(smap.n_params, dtype=torch.float64)
    strided = 0
    for gi, hi, _ in _stack_alike(smap.blocks):
        for index in (gi, hi):
            fast = Factor.of(index, x.device)
            slow = Factor(index.shape, None, index.reshape(-1))
            strided += fast.pieces is not None
            rows = torch.stack([x, x + 1])[1]  # a view with a storage offset, like the solver's buffer rows
            assert torch.equal(fast.gather(rows), slow.gather(rows))
            value = torch.randn(fast.shape, dtype=torch.float64)
            for op in ("write", "add"):
                a, b = x.clone(), x.clone()
                getattr(fast, op)(a, value)
                getattr(slow, op)(b, value)
                assert torch.equal(a, b)
    assert strided > 0


@pytest.mark.parametrize("riemannian_norm", [True, False])
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_ascent_direction_matches_metric_inner_products(metric, riemannian_norm):
    """The solver's step direction and its Gram row from ``ascent_direction`` (``<R e, v>_g = <e, v>`` for horizontal
    ``v``, ``<d, d>_g`` summed block by block) equal the Riemannian gradient and full metric inner products, also when
    the gradient is consumed in place (epsilon = 0)."""
    model = tiny_bert()
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    options = SpaceOptions(metric, epsilon=0.0, riemannian_norm=riemannian_norm)
    space = PerturbationSpace(theta0, map_symmetries(model).blocks, options)
    space.elementwise.CHUNK = 1000  # several blocks even on a tiny model
    g = torch.Generator().manual_seed(0)
    egrad = torch.randn(theta0.shape, generator=g, dtype=torch.float64)
    reference = space.riemannian_gradient(egrad)
    vectors = torch.stack([space.horizontal(torch.randn(theta0.shape, generator=g, dtype=torch.float64)) for _ in "ab"])
    slow = [float(space.inner_product(reference, v)) for v in vectors]
    for in_place in (False, True):
        e = egrad.clone()
        out = e if in_place else torch.empty_like(e)
        d, square, fast = space.ascent_direction(e, vectors, out=out)
        assert d is out
        assert torch.allclose(d, reference, rtol=1e-12, atol=1e-15)
        assert square == pytest.approx(float(space.inner_product(reference, reference)), rel=1e-9)
        assert fast == pytest.approx(slow, rel=1e-9)
        assert not in_place or not torch.equal(e, egrad)  # the gradient was consumed, not copied


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_pair_temporaries_carved_from_idle_buffers_change_no_bit(metric):
    """Directions, geodesic points and pullbacks are bit-identical whether their pair temporaries are fresh, carved
    from a large idle buffer, or partly carved from one too small to hold them all."""
    model = tiny_bert()
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    space = PerturbationSpace(theta0, map_symmetries(model).blocks, SpaceOptions(metric, epsilon=0.0))
    g = torch.Generator().manual_seed(0)
    egrad, cotangent = (torch.randn(theta0.shape, generator=g, dtype=torch.float64) for _ in "ab")
    xi = space.horizontal(1e-2 * torch.randn(theta0.shape, generator=g, dtype=torch.float64))
    vectors = xi[None]
    pair_size = sum(group.g.shape.numel() + group.h.shape.numel() for group in space.pairs)
    results = []
    nan = float("nan")
    for idle in (None, torch.full_like(theta0, nan), torch.full((pair_size + 7,), nan, dtype=torch.float64)):
        space.lend(idle)
        d, square, products = space.ascent_direction(egrad.clone(), vectors, out=torch.empty_like(theta0))
        point, grad = torch.empty_like(theta0), cotangent.clone()
        space.exp_point(xi, point, True, idle=None if idle is None else idle.clone())(grad, idle=idle)
        results.append((d, square, products, point, grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(results[0], other))
