"""Auto-PGD with its bookkeeping on the device (hf_geosharp/engine/solvers/device_climb.py): the same decisions as
the host reference (climb.py), and no host read inside a step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hf_geosharp as gs
from hf_geosharp.engine.device_paths import gpu_paths
from hf_geosharp.engine.solvers import device_climb
from hf_geosharp.engine.solvers.apgd import apgd
from hf_geosharp.engine.solvers.device_climb import DeviceMasks, HostMasks, masks_for
from hf_geosharp.engine.solvers.schedule import as23_checkpoints

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_batches, tiny_bert
from .fixtures.objective import tiny_objective as _objective
from .test_solver import _Bowl, _Line


def _same(device, host, rel):
    assert len(device.losses) == len(host.losses) and device.start_kinds == host.start_kinds
    assert device.losses == pytest.approx(host.losses, rel=rel)
    assert device.max_loss == pytest.approx(host.max_loss, rel=rel)
    assert device.best_norm == pytest.approx(host.best_norm, rel=rel)
    assert device.start_values == pytest.approx(host.start_values, rel=rel, abs=rel)
    assert device.verdict(1e-3, 2) == host.verdict(1e-3, 2)


@pytest.mark.parametrize(("metric", "rho", "rel"), [("inv", 5.0, 1e-12), (None, 5.0, 1e-12), ("mix", 1.0, 1e-8)])
@pytest.mark.parametrize("keep", [False, True])
def test_device_steps_take_the_host_references_decisions(metric, rho, rel, keep):
    """The same steps, halvings, restarts and stops as the host reference on a float64 BERT: the losses agree to
    rounding, the number of evaluated points exactly. (Where the previous iterate is the best point, the device
    combines three vectors in another order; mix's iterates on this model do not settle in 20 steps, its gap stays
    far from 0, and the landscape amplifies that rounding to 1e-11.)"""
    model = tiny_bert(torch.float64)
    for kw in (dict(steps=20), dict(steps=20, max_steps=60, tol=1e-6)):
        space, objective = _objective(model, metric, rho)
        host = apgd(space, objective, rho=rho, keep_best_gradient=keep, host_steps=True, **kw)
        device = apgd(space, objective.on_device, rho=rho, keep_best_gradient=keep, **kw)
        _same(device, host, rel)


@pytest.mark.parametrize("case", ["line", "bowl"])
def test_device_starts_match_the_host_reference(case):
    """``steps="auto"`` with its further starts (antipode, near, random probes) and the slope stop: the starts, their
    kinds and values, the certificate and the steps are the host reference's."""
    space = _Line(2000, rho=0.3) if case == "line" else _Bowl(200, rho=0.3, radial=10.0, a=1.0, s=2.0, c=0.1)
    runs = [apgd(space, space.objective, rho=space.rho, steps=20, max_steps=640, keep_best_gradient=False,
                 generator=torch.Generator().manual_seed(0), host_steps=host) for host in (True, False)]
    _same(runs[1], runs[0], 1e-12)
    assert len(runs[1].start_values) >= 3


class _Syncs(TorchDispatchMode):
    """Counts the host's waits for the device outside the objective: ``_local_scalar_dense`` (``item``, ``float``,
    ``bool``) at dispatch; ``tolist``, ``item``, ``cpu`` and ``numpy`` as calls (on a CPU tensor they never reach the
    dispatcher)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    def __init__(self, syncs: _Syncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.syncs.paused and func in (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy):
            self.syncs.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("metric", ["inv", None])
def test_a_step_reads_nothing_on_the_host_between_checks(metric):
    """Counted outside the model's calls: from one step's evaluation to the next, the host waits for the device
    only at a check (one read at each step-size checkpoint and at the end), never inside a step."""
    space, objective = _objective(tiny_bert(), metric, 0.5)
    syncs = _Syncs()
    marks: list[tuple[int, int]] = []  # syncs counted when each evaluation began and ended

    def counted(xi, need_grad, out=None):
        begin = syncs.count
        syncs.paused = True
        try:
            return objective.on_device(xi, need_grad, out=out)
        finally:
            syncs.paused = False
            marks.append((begin, syncs.count))

    with gpu_paths(), _Calls(syncs), syncs:  # the step as a GPU runs it (a CPU reads its masks on the host)
        result = apgd(space, counted, rho=0.5, steps=20, keep_best_gradient=True)
    assert result.steps_used == 20 and len(marks) >= 21  # the clean point, 20 steps (and the final gap's gradient)
    between = [marks[k + 2][0] - marks[k + 1][1] for k in range(19)]  # after step k's evaluation, to step k + 1's
    checks = set(as23_checkpoints(20))
    assert between == [1 if k in checks else 0 for k in range(19)]
    assert sum(between) < 19 // 2  # fewer reads than steps


def test_the_steps_scalars_compile_to_one_graph_and_give_the_eager_numbers():
    """``compile`` captures the step's scalar updates whole (``fullgraph=True``: a graph break would raise);
    ``aot_eager`` runs the captured graphs with the eager kernels, so the solve's numbers are the eager path's (to
    1e-6 relative), with the same steps, and under ``steps="auto"`` the same starts. (On a BERT, with the space's
    geometry captured too: tests/test_capture.py.)"""
    torch._dynamo.reset()
    bowl = _Bowl(200, rho=0.3, radial=10.0, a=1.0, s=2.0, c=0.1)
    runs = [apgd(bowl, bowl.objective, rho=bowl.rho, steps=20, max_steps=640,
                 generator=torch.Generator().manual_seed(0), compile=backend)
            for backend in ("off", "aot_eager")]
    _same(runs[1], runs[0], 1e-6)


@pytest.mark.parametrize("measure", ["geodesic", "adaptive"])
def test_the_last_iterate_takes_its_gradient_from_its_own_forward(measure, monkeypatch):
    """A fixed-step climb's last iterate keeps its forward's graph and takes its gradient from it where it is the best
    point (its gap needs it): the same numbers, bit for bit, as a forward-only last step followed by a forward and
    backward at the best point, with one forward less per batch where the last iterate is the best point."""
    from hf_geosharp.engine.model_function import objective as objective_module

    model, batches = tiny_bert(torch.float64), tiny_batches(2)
    forwards = [0]
    on_device, pending = objective_module.Objective.on_device, objective_module.Objective.pending

    def counted(self, *args, **kwargs):
        forwards[0] += 1
        return on_device(self, *args, **kwargs)

    def counted_pending(self, *args, **kwargs):
        forwards[0] += 1
        return pending(self, *args, **kwargs)

    fn = gs.geodesic_sharpness if measure == "geodesic" else gs.adaptive_sharpness
    monkeypatch.setattr(objective_module.Objective, "on_device", counted)
    runs = []
    for last in (counted_pending, None):
        monkeypatch.setattr(objective_module.Objective, "pending", last)
        forwards[0] = 0
        res = fn(model, batches, rho=0.05, steps=6, progress=False)
        runs.append((res, forwards[0]))
    (new, n_new), (old, n_old) = runs
    assert new.per_batch == old.per_batch and new.stationarity_gap == old.stationarity_gap
    assert new.breakdown == old.breakdown
    assert n_new == n_old - 2  # both batches end at their best point at this small radius


class _VectorSelections(TorchDispatchMode):
    """Counts the selections (``where``) and copies that write a whole vector of ``n`` coordinates."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.where, self.copies = n, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.n:
            if func.overloadpacket is torch.ops.aten.where:
                self.where += 1
            elif func.overloadpacket is torch.ops.aten.copy_:
                self.copies += 1
        return out


@pytest.mark.parametrize("keep", [False, True])
def test_a_cpu_reads_its_masks_on_the_host_with_the_same_numbers_bit_for_bit(keep, monkeypatch):
    """On a CPU a mask is read on the host (free there) and a masked copy becomes a copy or nothing: the losses,
    value, norm and gap equal the device masks' bit for bit, fixed-step and ``steps="auto"``, and no selection passes
    over a whole vector (the device masks make some). Only the masks change between the two runs (the rest of the
    step takes the CPU's forms in both)."""
    assert isinstance(masks_for(torch.device("cpu")), HostMasks)
    with gpu_paths():
        assert type(masks_for(torch.device("cpu"))) is DeviceMasks
    assert type(masks_for(torch.device("meta"))) is DeviceMasks
    model = tiny_bert(torch.float32)
    for kw in (dict(steps=12), dict(steps=12, max_steps=48, tol=1e-6)):
        space, objective = _objective(model, "inv", 0.5)
        n = space.empty().numel()
        runs, counts = [], []
        for masks in (DeviceMasks, HostMasks):
            counter = _VectorSelections(n)
            monkeypatch.setattr(device_climb, "masks_for", lambda device, masks=masks: masks())
            with counter:
                runs.append(apgd(space, objective.on_device, rho=0.5, keep_best_gradient=keep,
                                 generator=torch.Generator().manual_seed(0), **kw))
            counts.append(counter)
        device, host = runs
        assert device.losses == host.losses and device.max_loss == host.max_loss
        assert device.best_norm == host.best_norm and device.start_values == host.start_values
        assert device.start_gaps == host.start_gaps or all(map(math.isnan, device.start_gaps + host.start_gaps))
        assert device.start_kinds == host.start_kinds
        assert counts[0].where > 0 and counts[1].where == 0
