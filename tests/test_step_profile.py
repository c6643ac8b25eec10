"""The step-profile benchmark's clock: its stages partition the solve's time, and the engine is left unpatched."""

from __future__ import annotations

import time

import pytest
import torch

import hf_geosharp as gs
from benchmarks import step_profile

from .fixtures.hf_models import one_thread, tiny_bert  # noqa: F401  (one_thread: autouse)


def _batches(model, n: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, model.config.vocab_size, (4, 12), generator=g),
             "labels": torch.randint(0, 2, (4,), generator=g)} for _ in range(n)]


@pytest.mark.parametrize("measure", ["adaptive_clean", "geodesic_inv"])
def test_stages_partition_the_solve_and_the_engine_is_restored(measure):
    model, originals = tiny_bert(), [getattr(owner, attr) for owner, attr, _, _ in step_profile.PATCHES]
    rule = step_profile.solver.keeps_best_gradient
    batches, smap = _batches(model), gs.map_symmetries(model)
    clock = step_profile.StageClock()
    start = time.perf_counter()
    with step_profile.profiled(clock), clock.stage("outer"):
        value = step_profile.solve(measure, model, batches, smap, steps=3, rho=0.05).value
    measured = time.perf_counter() - start
    assert [getattr(owner, attr) for owner, attr, _, _ in step_profile.PATCHES] == originals
    assert step_profile.solver.keeps_best_gradient is rule and len(clock.kept_best_gradient) == 2  # one per batch
    assert value == step_profile.solve(measure, model, batches, smap, steps=3, rho=0.05).value  # timing changes nothing
    assert set(clock.cpu) - {"outer"} <= set(step_profile.STAGES)
    assert clock.calls["substitution"] >= 2 * (3 + 1)  # (steps + 1) model calls per batch at least
    assert clock.calls["forward"] == clock.calls["substitution"] and clock.calls["backward"] >= 2 * 3
    assert (clock.calls["pair geometry"] > 0) == (measure != "adaptive_clean")
    assert all(v >= 0 for v in clock.wall.values())  # exclusive times: a child is never counted twice
    assert 0.9 * measured <= sum(clock.wall.values()) <= measured  # the stages partition the solve's time
