"""The elementwise geometry's list pass (``torch._foreach_*`` over the segments) against its block-by-block reference,
and its count of operations, which must not grow with the number of segments."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.launch import OpCounter
from hf_geosharp.engine.device_paths import gpu_paths
from hf_geosharp.engine.geometry.elementwise import ElementwiseGeometry, blocked_products
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert


def _segments(n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Segments of every kind: plain weights, exact zeros among them, a whole zero segment, weights below the zero
    tolerance that are not zero."""
    segments = [torch.randn(37 + 11 * i, generator=generator, dtype=torch.float64) for i in range(n)]
    segments[1][::3] = 0.0
    segments[2].zero_()
    segments[3][5] = 1e-14
    return segments


def _selections(n: int, sizes: list[int], generator: torch.Generator) -> tuple[list, list]:
    """Per segment ``measure`` and ``keep``: all, none (kept, frozen, part kept), part measured (rest kept or not)."""
    measure: list = [True] * n
    keep: list = [False] * n
    measure[4], keep[4] = False, True  # another geometry's segment
    measure[5] = False  # frozen
    measure[6], keep[6] = False, torch.rand(sizes[6], generator=generator) < 0.5
    part = torch.rand(sizes[7], generator=generator) < 0.5
    measure[7], keep[7] = part, ~part
    measure[8] = torch.rand(sizes[8], generator=generator) < 0.5
    return measure, keep


@pytest.mark.parametrize("chunk", [1 << 20, 50])
@pytest.mark.parametrize("in_place", [True, False])
def test_list_pass_matches_the_blockwise_reference(chunk, in_place):
    """Direction, ``<d, d>_g``, products and the saved gradient of the list pass equal the block-by-block reference
    (float64, to 1e-12) on segments of every kind, with blocks that cut segments or not; kept coordinates of ``out``
    are left alone by both."""
    g = torch.Generator().manual_seed(0)
    segments = _segments(12, g)
    sizes = [s.numel() for s in segments]
    measure, keep = _selections(12, sizes, g)
    n = sum(sizes)
    egrad = torch.randn(n, generator=g, dtype=torch.float64)
    vectors = torch.randn(4, n, generator=g, dtype=torch.float64)[::2]  # strided rows, as the solver's pool gives
    results = []
    for reference in (False, True):
        geo = ElementwiseGeometry(segments, measure=measure, keep=keep, reference=reference)
        geo.CHUNK = chunk
        e = egrad.clone()
        out = e if in_place else torch.full_like(e, 7.0)
        save = torch.full_like(e, float("nan"))
        square, products = geo.riemannian_gradient_pass(e, out, vectors, save)
        results.append((out.clone(), square, products, save))
    (d, square, products, save), (d_ref, square_ref, products_ref, save_ref) = results
    assert torch.allclose(d, d_ref, rtol=1e-12, atol=0)
    assert torch.equal(save, egrad) and torch.equal(save_ref, egrad)
    assert float(square) == pytest.approx(float(square_ref), rel=1e-12)
    assert torch.allclose(products, products_ref, rtol=1e-12, atol=0)
    kinds = ElementwiseGeometry(segments, measure=measure, keep=keep).kinds()
    assert kinds.scaled and kinds.zeroed and kinds.blockwise  # every kind met
    assert 3 in kinds.blockwise and 2 in kinds.scaled  # tiny weights go block by block; zeros are scaled (to 0)


@pytest.mark.parametrize("paths", ["host", "gpu"])
def test_blocked_products_are_the_matrix_vector_product(paths):
    """Both forms (a CPU's: one matrix-vector product per block; a GPU's: one batched product per row) are
    ``vectors @ x``, and each issues what its form says."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g, dtype=torch.float64)
    vectors = torch.randn(3, 1000, generator=g, dtype=torch.float64)
    for block in (7, 100, 1000, 4096):
        with gpu_paths() if paths == "gpu" else contextlib.nullcontext(), _Ops() as ops:
            products = blocked_products(vectors, x, block)
        assert torch.allclose(products, vectors @ x, rtol=1e-12, atol=1e-12)
        blocks = -(-1000 // block)
        if paths == "host":
            assert ops["mv"] == blocks and ops["bmm"] == 0
        else:
            assert ops["bmm"] == (3 if 1000 >= block else 0) and ops["mv"] == 0
    assert blocked_products(vectors[:0], x, 7).shape == (0,)


class _Ops(TorchDispatchMode):
    """Counts operators by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _pass_kernels(n_segments: int) -> int:
    g = torch.Generator().manual_seed(0)
    segments = [torch.randn(64, generator=g) for _ in range(n_segments)]
    for s in segments[1::4]:
        s.zero_()  # frozen (zero biases of a random-init model)
    measure = [True] * n_segments
    keep = [False] * n_segments
    for i in range(2, n_segments, 4):
        measure[i], keep[i] = False, True  # pair segments
    for i in range(3, n_segments, 4):
        measure[i] = False  # frozen by the caller
    geo = ElementwiseGeometry(segments, measure=measure, keep=keep)
    n = sum(s.numel() for s in segments)
    egrad, vectors = torch.randn(n, generator=g), torch.randn(2, n, generator=g)
    geo.riemannian_gradient_pass(egrad.clone(), egrad.clone(), vectors)  # sorts the segments once
    counter = OpCounter()
    with counter:
        geo.riemannian_gradient_pass(egrad, egrad, vectors, save=torch.empty_like(egrad))
    return counter.ops["outside", "kernel"]


def test_list_pass_kernels_do_not_grow_with_the_segments():
    """The per-step pass issues the same operations for 8 segments as for 80 (one list operation per kind)."""
    few, many = _pass_kernels(8), _pass_kernels(80)
    assert few == many
    assert many <= 12


@pytest.mark.parametrize("metric", [None, "inv", "mix"])
def test_space_direction_is_the_reference_one_on_model_parameters(metric):
    """The space built on a model's parameters (segments of every kind the engine meets: pairs kept, zero-free
    weights, the pair geometry's segments) gives the reference pass's direction and products."""
    model = tiny_bert()
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[0].zero_()  # a padding row: exact zeros in a segment
    params = [p.detach() for p in model.parameters()]
    blocks = map_symmetries(model).blocks
    g = torch.Generator().manual_seed(0)
    n = sum(p.numel() for p in params)
    egrad = torch.randn(n, generator=g, dtype=torch.float64)
    results = []
    for reference in (False, True):
        space = PerturbationSpace(params, blocks, SpaceOptions(metric, epsilon=0.0))
        space.elementwise.reference = reference
        vectors = torch.stack([space.horizontal(torch.randn(n, generator=torch.Generator().manual_seed(k),
                                                            dtype=torch.float64)) for k in (1, 2)])
        e = egrad.clone()
        results.append(space.ascent_direction(e, vectors, out=e))
    (d, square, products), (d_ref, square_ref, products_ref) = results
    assert torch.allclose(d, d_ref, rtol=1e-12, atol=0)
    assert square == pytest.approx(square_ref, rel=1e-12)
    assert products == pytest.approx(products_ref, rel=1e-12)
