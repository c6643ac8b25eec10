"""The step captured by ``torch.compile(fullgraph=True)`` (``compile=...``, hf_geosharp/engine/capture.py): the space's
direction pass, geodesic point and pullback and the solver's scalar updates trace whole (a graph break raises) and
give the eager path's numbers. On a CPU the graphs run with backend ``aot_eager`` (the eager kernels); CUDA graphs
(``compile="reduce-overhead"``) need CUDA and are refused elsewhere before any work."""

from __future__ import annotations

import pytest
import torch

from hf_geosharp.engine.capture import capture_choice
from hf_geosharp.engine.solvers.apgd import apgd

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_batches, tiny_bert
from .test_device_climb import _objective, _same

BACKEND = "aot_eager"  # inductor compiles for minutes on a CI CPU; the capture is the same


@pytest.fixture(scope="module")
def spaces():
    """One float32 tiny-BERT space and objective per measure, shared so that each compiles its step once."""
    torch._dynamo.reset()
    model = tiny_bert(torch.float32)
    return {metric: _objective(model, metric, 0.5) for metric in (None, "inv", "mix")}


def _step(space, grad, vectors, xi):
    """One step's geometry: the direction over the gradient with its sums, the point ``Exp(w; xi)`` and the pullback
    of a cotangent."""
    direction = grad.clone()
    _, square, products = space.ascent_direction(direction, vectors, out=direction, host=False)
    point = space.empty()
    pullback = space.exp_point(xi, point, True)
    pulled = grad.clone()
    if pullback is not None:
        pullback(pulled)
    return [direction, square, products, point, pulled]


@pytest.mark.parametrize("metric", [None, "inv", "mix"])
def test_the_captured_step_geometry_gives_the_eager_numbers(spaces, metric):
    """Direction, its Gram sums, the geodesic point and the pullback, captured vs eager, in float32: equal to 1e-6
    relative (the pairs' writes become index writes in the graph; the arithmetic is the same)."""
    space, _ = spaces[metric]
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(space.numel, generator=g)
    vectors = torch.randn(2, space.numel, generator=g)
    xi = 1e-2 * torch.randn(space.numel, generator=g)
    with space.captured(BACKEND):  # first: what the space caches on first use is made before the capture
        captured = _step(space, grad, vectors, xi)
    eager = _step(space, grad, vectors, xi)
    assert space._capture is None  # the context leaves the space eager again
    for c, e in zip(captured, eager):
        assert torch.allclose(c, e, rtol=1e-6, atol=1e-6 * float(e.abs().max()))
    if metric is not None:  # the pairs moved: the correction and the pullback are not the identity
        assert not torch.equal(eager[3], torch.cat([b.reshape(-1) for b in space.base]) + xi)
        assert not torch.equal(eager[4], grad)


@pytest.mark.parametrize("metric", ["inv", None])
def test_a_captured_solve_gives_the_eager_value_and_certificate(spaces, metric):
    """A short solve with the whole step captured (geometry and scalar updates): the same losses, value, best
    point's norm, gap and verdict as eager, to 1e-6 relative."""
    space, objective = spaces[metric]
    runs = [apgd(space, objective.on_device, rho=0.5, steps=8, compile=compile) for compile in ("off", BACKEND)]
    _same(runs[1], runs[0], 1e-6)
    assert runs[1].start_gaps == pytest.approx(runs[0].start_gaps, rel=1e-6)


def test_cuda_graphs_are_refused_on_a_cpu_before_any_work(spaces):
    space, objective = spaces["inv"]
    calls = []

    def counted(xi, need_grad, out=None):
        calls.append(1)
        return objective.on_device(xi, need_grad, out)

    with pytest.raises(ValueError, match="CUDA device"):
        apgd(space, counted, rho=0.5, steps=2, compile="reduce-overhead")
    with pytest.raises(ValueError, match="no torch.compile backend"):
        apgd(space, counted, rho=0.5, steps=2, compile="no-such-backend")
    space.shard = object()  # a sharded space sums over the ranks between its operations: refused
    try:
        with pytest.raises(ValueError, match="sharded space"):
            apgd(space, counted, rho=0.5, steps=2, compile=BACKEND)
    finally:
        space.shard = None
    assert not calls and space._capture is None
    assert capture_choice("off", torch.device("cpu")) == "off"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_solve_as_cuda_graphs_gives_the_eager_numbers():
    """``compile="reduce-overhead"`` on CUDA: inductor's kernels replayed as CUDA graphs, the eager path's numbers
    (float32, 1e-5 relative: inductor fuses and reorders float32 sums)."""
    torch._dynamo.reset()
    space, objective = _objective(tiny_bert(torch.float32).cuda(), "inv", 0.5)
    objective.batch = {k: v.cuda() for k, v in objective.batch.items()}
    runs = [apgd(space, objective.on_device, rho=0.5, steps=8, compile=compile)
            for compile in ("off", "reduce-overhead")]
    _same(runs[1], runs[0], 1e-5)


def test_the_compile_setting_reaches_the_solver_from_every_face():
    """One declaration (``Settings.compile``): the command lines' ``--compile``, the public functions' keyword and
    the engine's settings; a bad value or CUDA graphs on a CPU model are refused before any work, and results and
    cache keys do not record it (it changes no number beyond rounding)."""
    import hf_geosharp as gs
    from hf_geosharp.cli import build_parser
    from hf_geosharp.commands.common import settings_of
    from hf_geosharp.engine.settings import RunSettings
    from hf_geosharp.measures import Settings

    args = build_parser().parse_args(["run", "--model", "m", "--dataset", "d", "--compile", "aot_eager"])
    settings = settings_of(args)
    assert settings.compile == "aot_eager" and Settings().compile == "off" and "compile" not in settings.as_dict()
    assert RunSettings(rho=0.1, compile="aot_eager").compile == "aot_eager"
    assert "compile" not in RunSettings(rho=0.1, compile="aot_eager").config()
    with pytest.raises(ValueError, match="no torch.compile backend"):
        RunSettings(rho=0.1, compile="no-such-backend")
    model = tiny_bert(torch.float32)
    with pytest.raises(ValueError, match="CUDA device"):
        gs.geodesic_sharpness(model, tiny_batches(1), rho=0.1, compile="reduce-overhead", progress=False)
    with pytest.raises(ValueError, match="CUDA device"):
        gs.adaptive_sharpness(model, tiny_batches(1), rho=0.1, compile="reduce-overhead", progress=False)


_RECORDED: list[list[str]] = []


def _recording(gm, example_inputs):
    """A ``torch.compile`` backend that records each graph's operations and runs it as traced."""
    _RECORDED.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
    return gm.forward


def test_the_captured_graphs_hold_no_list_pass_over_the_flat_vector(spaces):
    """The elementwise list passes (``torch._foreach_*`` over the segments' views of one flat vector) stay outside the
    graphs: inductor lowers list writes into views of one buffer as a single kernel that tests every segment's bounds
    at every coordinate (0.49 s a call at MiniLM on a CPU core, against 10 ms eager). The pairs' geometry is still
    captured."""
    if "geosharp_recording" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_recording, name="geosharp_recording")
    graphs = _RECORDED
    graphs.clear()
    torch._dynamo.reset()
    space, _ = spaces["inv"]
    g = torch.Generator().manual_seed(2)
    grad, xi = torch.randn(space.numel, generator=g), 1e-2 * torch.randn(space.numel, generator=g)
    with space.captured("geosharp_recording"):
        captured = _step(space, grad, torch.randn(1, space.numel, generator=g), xi)
    torch._dynamo.reset()
    assert len(graphs) == 3  # the pairs' direction, their Exp2 correction, its pullback
    assert all(graph and not any("_foreach" in target for target in graph) for graph in graphs)
    assert any("bmm" in target for graph in graphs for target in graph)
    assert all(torch.isfinite(t).all() for t in captured)


def test_captured_solves_keep_their_graphs_to_themselves():
    """Each solve compiles its own copy of the step's functions: dynamo counts recompilations per code object, and
    every solve's space is new, so graphs of the shared code would pile up until a ``fullgraph=True`` call fails.
    With the recompile limit at 2, captured solves of three measures over new spaces, twice, must all run, and so
    must three calls of the public function (the solver's scalar updates run under the call's embedding-row mode)."""
    import hf_geosharp as gs

    torch._dynamo.reset()
    model = tiny_bert(torch.float32)
    with torch._dynamo.config.patch(recompile_limit=2):
        for metric in ("inv", "mix", None) * 2:
            space, objective = _objective(model, metric, 0.5)
            run = apgd(space, objective.on_device, rho=0.5, steps=6, compile=BACKEND)
            assert run.max_loss > run.clean_loss
        values = [gs.geodesic_sharpness(model, tiny_batches(1), metric="inv", rho=0.1, steps=4, progress=False,
                                        compile=BACKEND).value for _ in range(3)]
        assert values[0] > 0 and values.count(values[0]) == 3
    torch._dynamo.reset()


def test_a_new_space_over_the_same_model_reuses_the_graphs():
    """Two solves over one model build two spaces with the same capture key: the second traces nothing (the graphs
    of the first serve it); a space of another measure traces its own."""
    if "geosharp_recording" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_recording, name="geosharp_recording")
    _RECORDED.clear()
    torch._dynamo.reset()
    model = tiny_bert(torch.float32)
    g = torch.Generator().manual_seed(3)
    counts = []
    for metric in ("inv", "inv", "mix"):
        space, _ = _objective(model, metric, 0.5)
        grad, xi = torch.randn(space.numel, generator=g), 1e-2 * torch.randn(space.numel, generator=g)
        with space.captured("geosharp_recording"):
            _step(space, grad, torch.randn(1, space.numel, generator=g), xi)
        counts.append(len(_RECORDED))
    torch._dynamo.reset()
    assert counts[0] == 3 and counts[1] == counts[0] and counts[2] == 2 * counts[0]
