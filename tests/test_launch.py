"""Launch counts of a solver step (benchmarks/launch.py): what does not grow with depth, and where the host waits.

Counted with a ``TorchDispatchMode`` on tiny random-init BERTs of 2 and 6 layers; per step = the difference between
a 6-step and a 2-step solve, over 4. Counts, not times: they are the same on every machine.
"""

from __future__ import annotations

import pytest

from benchmarks import launch
from benchmarks.models import ModelSize

#: The pair geometry's operations: one stacked batch per pair group (one head chunk where the workspace has room),
#: so their kernels per step must not grow with depth.
PAIR_FILES = ("engine/geometry/gl_quotient.py",)


#: Per-step kernels outside the model may differ between depths by the solver's path (how many Gram rows a step's
#: products take, how often a step is repeated), never by a count per layer or per parameter tensor (at these sizes,
#: one operation per tensor per step adds dozens).
PATH_SLACK = 2.0
#: A radius at which the halving rule restarts from the best point at the same checkpoint at both depths: a restart
#: costs a step one more pair-geometry pass, which is the solver's path, not depth (at rho 0.1 the 6-layer mix solve
#: restarts where the 2-layer one does not, and counts 50 more kernels a step).
RHO = 0.01


@pytest.fixture(scope="module")
def counts() -> dict[int, dict]:
    measures = ("adaptive_clean", "geodesic_inv", "geodesic_mix")
    return {layers: launch.count_shape(ModelSize(f"tiny-{layers}", layers, 32, 4), measures, rho=RHO)
            for layers in (2, 6)}


def _pair_kernels(row: dict) -> float:
    files = row["measures"]["geodesic_inv"]["outside_kernels_by_file"]
    return sum(files.get(f, 0.0) for f in PAIR_FILES)


def test_pair_geometry_kernels_do_not_grow_with_depth(counts):
    shallow, deep = _pair_kernels(counts[2]), _pair_kernels(counts[6])
    assert shallow > 0  # the pairs were counted
    assert deep == shallow  # three times the pairs, the same operations: one chunk per group at both depths


@pytest.mark.parametrize("measure", [
    "adaptive_clean",
    "geodesic_inv",
    "geodesic_mix",
])
def test_step_kernels_outside_the_model_do_not_grow_with_depth(counts, measure):
    """The whole solver step outside the model (geometry, direction, update, substitution) issues as many kernels
    at 6 layers as at 2: the elementwise coordinates go through list operations, the pairs through stacked groups."""
    shallow, deep = (counts[layers]["measures"][measure]["outside"]["kernels"] for layers in (2, 6))
    assert shallow > 0
    assert deep <= shallow + PATH_SLACK, counts[6]["measures"][measure]["outside_kernels_by_file"]


#: Issue 49's targets for the kernels of a step outside the model, per measure (at 6 x 384, 12 x 768, 24 x 1024).
TARGETS = {"adaptive_clean": 100, "geodesic_inv": 300, "geodesic_mix": 300}
#: The step's bookkeeping (device_climb.py: inner products, step sizes, projections, the best point, the stopping
#: test) works on a state vector and a 3 x 3 Gram matrix: a few dozen kernels per step whatever the model.
BOOKKEEPING_KERNELS = 40


@pytest.mark.parametrize("measure", list(TARGETS))
def test_step_kernels_outside_the_model_are_under_the_targets(counts, measure):
    """The targets hold at the tiny shapes. What a step issues outside the model does not grow with depth (above),
    nor with width (its operations are list operations and stacked pair groups; only the head chunks of the pair
    geometry can add kernels, where the workspace is too small for a group), so the tiny count is a floor of the
    count at the targets' shapes: a step that adds per-step kernels (the bookkeeping back as dozens of 0-dim
    operations, a per-tensor loop) fails here, in CI, before the launch suite would show it at 6 x 384."""
    for row in counts.values():
        m = row["measures"][measure]
        assert m["outside"]["kernels"] <= TARGETS[measure], m["outside_kernels_by_file"]
        assert m["outside_kernels_by_file"].get("engine/solvers/device_climb.py", 0.0) <= BOOKKEEPING_KERNELS


def test_no_sync_added_inside_the_model(counts):
    """The engine's embedding lookups (answered from the used rows) make the host wait at no forward of a step:
    inside the model's calls the syncs are the plain model's own."""
    for row in counts.values():
        m = row["measures"]["geodesic_inv"]
        plain = row["plain_forward_backward"]["syncs"]
        assert m["inside"]["syncs"] == plain * m["model_calls_per_step"]


def test_no_upload_in_a_step(counts):
    """No tensor is built from host data during a step (the solver's coefficients are written on the device)."""
    for row in counts.values():
        assert row["measures"]["geodesic_inv"]["outside"]["uploads"] == 0


def test_classification_of_ops():
    import torch

    aten = torch.ops.aten
    x = torch.ones(3)
    assert launch.classify(aten.view.default, (x, [3]), {}) == "view"
    assert launch.classify(aten.add_.Tensor, (x, x), {}) == "kernel"
    assert launch.classify(aten.mul.Tensor, (x, x), {}) == "kernel"
    assert launch.classify(aten._local_scalar_dense.default, (x[0],), {}) == "sync"
    assert launch.classify(aten.nonzero.default, (x,), {}) == "sync"
    assert launch.classify(aten.empty.memory_format, ([3],), {}) == "view"
    assert launch.classify(aten.lift_fresh.default, (x,), {}) == "upload"


#: A width at which one head chunk per pair group needs more scratch than the least workspace (1 Mi entries): with
#: no room from the bytes goal (patched to 0, as in a deep model), the groups are cut into chunks.
WIDE = ModelSize("wide", 2, 256, 4)


@pytest.fixture(scope="module")
def roomless() -> dict[tuple[int, bool], float]:
    """Geodesic inv's kernels a step outside the model at 2 and 6 layers of width 256, with the bytes goal leaving no
    room for the workspace, on the CPU (no free memory known) and under the GPU rule (80 GB free, simulated)."""
    from hf_geosharp.engine.solvers import memory

    goal, out = memory.BYTES_PER_PARAMETER_GOAL, {}
    memory.BYTES_PER_PARAMETER_GOAL = 0
    try:
        for layers in (2, 6):
            size = ModelSize(f"wide-{layers}", layers, WIDE.hidden, WIDE.heads)
            for gpu in (False, True):
                row = launch.count_shape(size, ("geodesic_inv",), rho=RHO, free=launch.SIMULATED_FREE if gpu else None)
                out[layers, gpu] = row["measures"]["geodesic_inv"]["outside"]["kernels"]
    finally:
        memory.BYTES_PER_PARAMETER_GOAL = goal
    return out


def test_where_the_goal_cuts_the_groups_a_gpu_with_room_keeps_one_chunk(roomless):
    """The rule that sizes the workspace prefers one chunk per pair group on a GPU with room: where the bytes goal
    alone would cut the groups into head chunks (the count then grows with depth, the control), the free memory of a
    GPU keeps the step's kernels independent of depth."""
    assert roomless[6, False] > roomless[2, False] + 50 * PATH_SLACK  # the control: chunks repeat the geometry
    assert roomless[6, True] <= roomless[2, True] + PATH_SLACK
    assert roomless[6, True] < roomless[6, False]
