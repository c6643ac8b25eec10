"""One rank of the sharded-sharpness checks in ``tests/test_sharded_sharpness.py``, run under ``torchrun`` (gloo).

``python -m torch.distributed.run --standalone --nproc_per_node N tests/fsdp_sharpness_worker.py ARCH OUT [--shard1]
[--boxes]``. Every rank builds the same seeded float64 model, measures it unsharded (the single-process reference),
shards it with ``shard_model``, measures it again with the same batches on every rank, with each rank given its share
of every batch, and with only some parameters trainable, and checks the shards bit for bit afterwards. Rank 0 writes
the numbers to ``OUT`` (JSON), and, per sharded measurement, how many embeddings had their unused rows left out. With
``--boxes`` the pair factors are laid out as strided boxes however small they are (a real model's size), and the
workspace is too small for a whole pair group (a real model's memory rule), so that the pairs' base point is read from
the weights a head chunk at a time rather than kept as a copy.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

import hf_geosharp as gs
from hf_geosharp.engine import runner
from hf_geosharp.engine.placement import fsdp
from hf_geosharp.engine.placement.sharding import shard_model
from hf_geosharp.engine.space import coordinates
from hf_geosharp.engine.space.workspace import Workspace

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from tests.fsdp_worker import build, placement_fn  # noqa: E402

KW = dict(rho=0.05, steps=6, progress=False, n_samples=4)


def measure(model: torch.nn.Module, batches: list[dict], smap: gs.SymmetryMap) -> dict[str, float]:
    out = {}
    for metric in ("inv", "mix"):
        for mode in ("worst", "average"):
            res = gs.geodesic_sharpness(model, batches, metric=metric, mode=mode, symmetry_map=smap, **KW)
            out[res.measure] = res.value
    out["adaptive_clean_worst"] = gs.adaptive_sharpness(model, batches, **KW).value
    out["adaptive_average"] = gs.adaptive_sharpness(model, batches, mode="average", **KW).value
    return out


def measure_trainable(model: torch.nn.Module, batches: list[dict]) -> dict[str, float]:
    """Geodesic inv and adaptive sharpness, worst case, with ``params="trainable"`` while the embeddings and the first
    layer are frozen (as when only adapters train); every flag is put back afterwards."""
    frozen = [p for n, p in model.named_parameters() if ("embed" in n or ".0." in n) and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    kw = {**KW, "params": "trainable"}
    out = {"geodesic_inv_worst": gs.geodesic_sharpness(model, batches, metric="inv", **kw).value,
           "adaptive_clean_worst": gs.adaptive_sharpness(model, batches, **kw).value}
    for p in frozen:
        p.requires_grad_(True)
    return out


def count_held_embeddings(counts: dict[str, int]) -> None:
    """Record, per measure and ``params``, how many embeddings the builder holds by their used rows only."""
    build = runner.build

    def recording(model, settings, placement, *args):
        space, objective = build(model, settings, placement, *args)
        counts[f"{settings.measure} {settings.params}"] = len(objective.placement.holding.rows)
        return space, objective

    runner.build = recording


def main() -> None:
    arch, path, shard1 = sys.argv[1], sys.argv[2], "--shard1" in sys.argv
    if "--boxes" in sys.argv:
        coordinates.strided_pieces = functools.partial(coordinates.strided_pieces, min_elements=1)
        fsdp.FsdpPlacement.workspace = lambda self, numel, dtype: Workspace(dtype, self.device, 1 << 10)
    model, batch, frozen = build(arch)
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):  # 6 examples: shares of 3 + 3 over two ranks, 2 + 2 + 1 + 1 over four (uneven)
        more = {k: v.clone() for k, v in batch.items()}
        more["input_ids"] = torch.randint(1, 50, more["input_ids"].shape, generator=g)
        batches.append({k: torch.cat([batch[k], more[k]]) for k in batch})
    smap = gs.map_symmetries(model)
    single = measure(model, batches, smap)
    single_trainable = measure_trainable(model, batches)
    shard_model(model, placement=placement_fn(model) if shard1 else None)
    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    held: dict[str, int] = {}
    count_held_embeddings(held)
    sharded = measure(model, batches, smap)
    rows = [torch.arange(b["labels"].shape[0]).tensor_split(world)[rank] for b in batches]
    shares = [{k: v[r] for k, v in b.items()} for b, r in zip(batches, rows)]
    shared = measure(model, shares, smap)
    trainable = measure_trainable(model, batches)
    intact = all(torch.equal(p.to_local(), shards[n]) for n, p in model.named_parameters())
    intact &= all(p.requires_grad == flags[n] for n, p in model.named_parameters())
    intact &= not any(m.training for m in model.modules())  # the fixture is in eval mode; still in it
    everyone = [None] * world
    dist.all_gather_object(everyone, intact)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"single": single, "sharded": sharded, "shares": shared, "intact": everyone, "held": held,
                       "trainable": [single_trainable, trainable]}, f)
    dist.barrier()  # every rank is done talking
    # Leave without running C++ destructors: under load, gloo's threads sometimes abort interpreter shutdown
    # ("terminate called without an active exception") after all the work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
