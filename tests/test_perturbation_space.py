"""The perturbation space's fast paths against their slow references: strided gathers and scatters vs index
operations, the solver's step direction and Gram row vs metric inner products, geometry run a few heads at a time in
a small workspace vs all heads at once."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_geosharp.engine.space.coordinates import Factor, stack_alike
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.engine.space.workspace import Workspace
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert


def test_strided_gathers_and_scatters_match_index_operations():
    model = tiny_bert()
    smap = map_symmetries(model)
    x = torch.randn(smap.n_params, dtype=torch.float64)
    strided = 0
    for gi, hi, _ in stack_alike(smap.blocks):
        for index in (gi, hi):
            fast = Factor.of(index, x.device)
            slow = Factor(index.shape, None, index)
            strided += fast.pieces is not None
            rows = torch.stack([x, x + 1])[1]  # a view with a storage offset, like the solver's buffer rows
            gathered = [f.gather(rows, torch.empty(index.shape, dtype=x.dtype)) for f in (fast, slow)]
            assert torch.equal(*gathered)
            heads = slice(1, max(2, index.shape[0] - 1))  # a range of heads, as the space's chunks use
            cut = [f.gather(rows, torch.empty(f.rows(heads), dtype=x.dtype), heads) for f in (fast, slow)]
            assert torch.equal(*cut) and torch.equal(cut[0], gathered[0][heads])
            value = torch.randn(fast.shape, dtype=torch.float64)
            for op in ("write", "add"):
                a, b = x.clone(), x.clone()
                fast.write(a, value, add=op == "add")
                slow.write(b, value, add=op == "add")
                assert torch.equal(a, b)
    assert strided > 0


@pytest.mark.parametrize(("metric", "riemannian_norm"),
                         [("inv", True), ("mix", True), ("inv", False), ("mix", False), (None, True)])
def test_ascent_direction_matches_metric_inner_products(metric, riemannian_norm):
    """The solver's step direction and its Gram row from ``ascent_direction`` (``<R e, v>_g = <e, v>`` for horizontal
    ``v``, ``<d, d>_g`` summed block by block) equal the Riemannian gradient and full metric inner products, also when
    the gradient is consumed in place (epsilon = 0). The blocks are small, so that the pass meets every kind: all
    coordinates movable (no mask), some frozen (the zero biases), pair coordinates kept for the pair geometry."""
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
def test_head_chunks_in_a_small_workspace_change_no_bit(metric):
    """Directions, geodesic points and pullbacks are bit-identical whether the geometry runs on all heads at once in
    a large workspace, one head at a time in a tiny one (fresh tensors for what does not fit), or in a workspace whose
    buffer starts full of NaN; ``<d, d>_g``, a sum over chunks, agrees to rounding."""
    model = tiny_bert()
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    g = torch.Generator().manual_seed(0)
    egrad, cotangent = (torch.randn(theta0.shape, generator=g, dtype=torch.float64) for _ in "ab")
    results = []
    for entries, poison in ((1 << 24, False), (7, False), (1 << 24, True)):
        ws = Workspace(torch.float64, "cpu", entries)
        if poison:
            ws.take((entries,)).fill_(float("nan"))
        space = PerturbationSpace(theta0, map_symmetries(model).blocks, SpaceOptions(metric, epsilon=0.0),
                                  workspace=ws)
        xi = space.horizontal(1e-2 * torch.randn(theta0.shape, generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.float64))
        d, square, products = space.ascent_direction(egrad.clone(), xi[None], out=torch.empty_like(theta0))
        point, grad = torch.empty_like(theta0), cotangent.clone()
        space.exp_point(xi, point, True)(grad)
        results.append((d, square, products, point, grad, len(space.pairs[0].chunks)))
    assert results[1][-1] > results[0][-1] == 1  # the tiny workspace really ran head by head
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][::3], other[::3]))  # direction, point, pullback
        assert other[1] == pytest.approx(results[0][1], rel=1e-14)  # <d, d>_g: summed chunk by chunk
        assert other[2] == results[0][2]


def test_held_bytes_counts_the_pair_caches_and_the_workspace():
    """What the solver's memory rule adds to its vectors: nothing for the elementwise space (its workspace is never
    used); for pairs, the nine float64 ``h x h`` factors of each head and the workspace, plus index maps or copies of
    the base point where a layout needs them (at most two entries per pair coordinate)."""
    model = tiny_bert()
    params = [p.detach() for p in model.parameters()]
    assert PerturbationSpace(params, [], SpaceOptions(None)).held_bytes == 0
    space = PerturbationSpace(params, map_symmetries(model).blocks, SpaceOptions("inv"))
    h = model.config.hidden_size // model.config.num_attention_heads
    caches = 9 * 8 * h * h * space.n_pairs
    workspace = space.workspace.entries * 8  # float64 model
    pair_coordinates = sum(g.g.shape.numel() + g.h.shape.numel() for g in space.pairs)
    assert caches + workspace <= space.held_bytes <= caches + workspace + 2 * 8 * pair_coordinates


@pytest.mark.parametrize("share", [0.3, 0.9, 2.0])
def test_a_workspace_limit_bounds_everything_the_pair_geometry_holds(share):
    """The workspace's limit (what the bytes goal leaves beside the solver's vectors) is for all the space holds: its
    ``h x h`` caches are planned in, so the workspace grows only into what they leave, and the whole space (after
    a step has made its working-dtype casts) stays within the limit, whether the groups run in chunks (the smaller
    shares) or whole with the base point kept."""
    model = tiny_bert().float()
    params = [p.detach() for p in model.parameters()]
    blocks = map_symmetries(model).blocks
    h = model.config.hidden_size // model.config.num_attention_heads
    caches = sum(b.G_index.shape[0] for b in blocks) * h * h * (9 * 8 + 4 * 4)
    largest = max(gi.numel() + hi.numel() for gi, hi, _ in stack_alike(blocks))
    limit = caches // 4 + int(share * 4 * largest)  # entries of float32
    space = PerturbationSpace(params, blocks, SpaceOptions("inv"), workspace=Workspace(torch.float32, "cpu", 16,
                                                                                       limit=limit))
    theta = torch.cat([p.reshape(-1) for p in params])
    space.ascent_direction(torch.randn_like(theta), theta[None] * 0, out=torch.empty_like(theta))
    space.exp_point(1e-3 * space.horizontal(torch.randn_like(theta)), torch.empty_like(theta), True)
    chunks = max(len(group.chunks) for group in space.pairs)
    assert (chunks > 1) == (share < 1)
    assert space.held_bytes <= 4 * limit


@pytest.mark.parametrize(("metric", "riemannian_norm"), [("inv", True), ("mix", True), ("inv", False), (None, True)])
def test_ascent_direction_saves_the_gradient_it_consumes_without_changing_a_bit(metric, riemannian_norm):
    """With ``save``, the direction pass also copies the gradient it overwrites (the solver's kept best-point
    gradient): the copy is the gradient, bit for bit, and the direction and its products are those of the pass
    without it."""
    model = tiny_bert()
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    options = SpaceOptions(metric, riemannian_norm=riemannian_norm)
    space = PerturbationSpace(theta0, map_symmetries(model).blocks, options)
    space.elementwise.CHUNK = 1000  # several blocks even on a tiny model
    g = torch.Generator().manual_seed(0)
    egrad = torch.randn(theta0.shape, generator=g, dtype=torch.float64)
    vectors = torch.stack([space.horizontal(torch.randn(theta0.shape, generator=g, dtype=torch.float64)) for _ in "ab"])
    plain, saving, saved = egrad.clone(), egrad.clone(), torch.full_like(egrad, float("nan"))
    d, square, products = space.ascent_direction(plain, vectors, out=plain)
    d_saving, square_saving, products_saving = space.ascent_direction(saving, vectors, out=saving, save=saved)
    assert torch.equal(saved, egrad) and torch.equal(d_saving, d)
    assert (square_saving, products_saving) == (square, products)


class _PairOps(TorchDispatchMode):
    """Counts the ATen calls made while the pair geometry runs (a frame of ``pair_group.py`` or ``gl_quotient.py`` on
    the stack: gathers, geometry and writes of the pair coordinates)."""

    FILES = ("engine/space/pair_group.py", "engine/geometry/gl_quotient.py")

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.endswith(self.FILES):
            frame = frame.f_back
        self.ops += frame is not None
        return func(*args, **(kwargs or {}))


def _bert(layers: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config).double()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_pair_operations_issue_as_many_ops_at_any_depth(metric):
    """Pairs of one shape from every layer go through each geometry operation as one stacked batch, gathered and
    written through strided views spanning the layers: a step's pair operations (the direction, the geodesic point
    and its pullback, an inner product, the horizontal projection) issue the same ATen calls for one layer as for
    three, and the pair factors really are strided boxes there (not one index operation per group)."""
    counts = []
    for layers in (1, 3):
        model = _bert(layers)
        theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        space = PerturbationSpace(theta, map_symmetries(model).blocks, SpaceOptions(metric))
        assert all(f.boxes is not None and len(group.chunks) == 1 for group in space.pairs for f in (group.g, group.h))
        g = torch.Generator().manual_seed(0)
        egrad, xi, cotangent = (torch.randn(theta.shape, generator=g, dtype=torch.float64) for _ in "abc")
        with _PairOps() as counter:
            space.ascent_direction(egrad.clone(), xi[None], out=torch.empty_like(theta))
            space.exp_point(1e-3 * xi, torch.empty_like(theta), True)(cotangent)
            space.inner_product(xi, egrad)
            space.horizontal(xi)
        counts.append(counter.ops)
    assert counts[0] == counts[1] > 0
