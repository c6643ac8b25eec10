"""One rank of the FSDP2 layout checks in ``tests/test_sharding.py``, run under ``torchrun`` on CPU with gloo.

``python -m torch.distributed.run --standalone --nproc_per_node N tests/fsdp_worker.py ARCH [--shard1]``. Every rank
builds the same seeded float64 model, keeps an unsharded copy as the reference, shards the model with
``shard_model`` and checks the layout against the copy; any failed check raises (non-zero exit). Prints
``FSDP-WORKER-OK`` on success.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.func import functional_call

from hf_geosharp.engine.placement import fsdp
from hf_geosharp.engine.placement.fsdp_layout import ShardedLayout, fsdp_state
from hf_geosharp.engine.placement.sharding import shard_model
from hf_geosharp.engine.solvers.memory import workspace_room
from hf_geosharp.engine.space.workspace import DEFAULT_ENTRIES

TOL = 1e-12
QKV = ("query", "key", "value", "q_proj", "k_proj", "v_proj")


def build(arch: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """A tiny seeded fp64 model with 3 labels (non-zero biases), one batch, and the name of a frozen parameter."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    if arch == "bert":
        config = BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=20,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model, frozen = BertForSequenceClassification(config), "bert.embeddings.token_type_embeddings.weight"
    else:
        config = LlamaConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=20, max_position_embeddings=16, num_labels=3, pad_token_id=0,
        )  # fmt: skip
        model, frozen = LlamaForSequenceClassification(config), "model.norm.weight"
    model = model.to(torch.float64).eval()
    with torch.no_grad():  # transformers initialises biases to zero, which would hide what bias rows do
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.get_parameter(frozen).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}
    return model, batch, frozen


def placement_fn(model: torch.nn.Module):
    """``Shard(1)`` for the q/k/v weights, FSDP's default ``Shard(0)`` for everything else."""
    from torch.distributed.tensor import Shard

    ids = {id(m.weight) for n, m in model.named_modules() if n.endswith(QKV)}
    return lambda p: Shard(1) if id(p) in ids else None


def ref_loss(ref: torch.nn.Module, batch: dict, delta: torch.Tensor, grad: bool = False):
    """Loss of the unsharded copy at ``theta0 + delta`` (global flat), and its gradient (global flat, zeros where
    frozen) when asked."""
    named = list(ref.named_parameters())
    leaves, start = {}, 0
    for name, p in named:
        leaves[name] = (p.detach() + delta[start : start + p.numel()].view_as(p)).requires_grad_(p.requires_grad)
        start += p.numel()
    loss = functional_call(ref, leaves, args=(), kwargs=batch).loss
    if not grad:
        return loss.detach(), None
    trainable = [leaves[n] for n, p in named if p.requires_grad]
    grads = iter(torch.autograd.grad(loss, trainable))
    flat = [next(grads).reshape(-1) if p.requires_grad else torch.zeros(p.numel(), dtype=p.dtype) for _, p in named]
    return loss.detach(), torch.cat(flat)


def check_localize(layout: ShardedLayout, ref: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(a) every rank's local segments, placed by ``localize``, rebuild every full parameter; the padding is zero."""
    local = torch.cat(layout.base())
    everyone = [torch.empty_like(local) for _ in range(layout.world)]
    dist.all_gather(everyone, local, group=layout.group)
    stacked = torch.stack(everyone)
    owner, pos = layout.localize(torch.arange(layout.global_numel))
    start = 0
    for name, p in ref.named_parameters():
        shaped = torch.arange(start, start + p.numel()).view(p.shape)  # localize keeps any shape
        o, q = layout.localize(shaped)
        assert o.shape == p.shape and torch.equal(stacked[o, q], p.detach()), name
        start += p.numel()
    assert start == layout.global_numel and layout.numel == sum(layout.local_sizes) == local.numel()
    used = torch.zeros(layout.numel, dtype=torch.bool)
    used[pos[owner == layout.rank]] = True
    assert torch.all(local[~used] == 0), "padding is not zero"
    assert int((owner == layout.rank).sum()) == int(used.sum()), "two global indices share a local position"
    return owner, pos


def local_of(layout: ShardedLayout, owner: torch.Tensor, pos: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """This rank's local vector of a global flat vector (zeros in the padding)."""
    out = torch.zeros(layout.numel, dtype=flat.dtype)
    mine = owner == layout.rank
    out[pos[mine]] = flat[mine]
    return out


def snapshot(model: torch.nn.Module, layout: ShardedLayout) -> dict:
    """Shards, padded shards, gradients and flags. Resharded first: FSDP's root keeps its parameters unsharded after a
    forward that has no backward, and the sharded parameters are what the model owns."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    params = list(model.parameters())
    return {
        "shards": [p._local_tensor.clone() for p in params],
        "padded": [t.clone() for t in layout.base()],
        "grads": [None if p.grad is None else p.grad._local_tensor.clone() for p in params],
        "requires_grad": [p.requires_grad for p in params],
        "training": [m.training for m in model.modules()],
    }


def check_unchanged(model: torch.nn.Module, layout: ShardedLayout, before: dict) -> None:
    """(d) shards bit-identical, FSDP reading from the model's own storage again, flags and grads as before."""
    after = snapshot(model, layout)
    assert all(torch.equal(a, b) for a, b in zip(after["shards"], before["shards"])), "shards changed"
    assert all(torch.equal(a, b) for a, b in zip(after["padded"], before["padded"])), "padded shards changed"
    for g0, g1 in zip(before["grads"], after["grads"]):
        assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), ".grad changed"
    assert after["requires_grad"] == before["requires_grad"] and after["training"] == before["training"]
    for p, own in zip(model.parameters(), layout.base()):
        assert own.untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr() or own.numel() == 0


def check_serving(model, ref, batch, layout, owner, pos, frozen_index: int) -> None:
    """(b) losses at perturbed points, (c) streamed gradients, theta changing inside one ``serving``."""
    base = torch.cat(layout.base())
    delta = torch.randn(layout.global_numel, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1e-2
    theta = base + local_of(layout, owner, pos, delta)
    want, want_grad = ref_loss(ref, batch, delta, grad=True)
    out = torch.full((layout.numel,), float("nan"), dtype=torch.float64)
    with layout.serving(theta.split(layout.local_sizes)):
        with torch.no_grad():
            assert abs(model(**batch).loss - want) < TOL, "loss at theta"
        with layout.stream_gradients(out.split(layout.local_sizes)) as filled:
            loss = model(**batch).loss
            loss.backward()
        assert abs(loss.detach() - want) < TOL, "loss at theta (with grad)"
        assert filled == [i != frozen_index for i in range(len(filled))], filled
        assert torch.allclose(out, local_of(layout, owner, pos, want_grad), rtol=0, atol=TOL), "gradient"
        with torch.no_grad():  # a forward without backward leaves FSDP's root unsharded ...
            assert abs(model(**batch).loss - want) < TOL, "loss at theta after a backward"
        theta.copy_(base + local_of(layout, owner, pos, -2 * delta))  # ... and theta moves: the next forward sees it
        with torch.no_grad():
            assert abs(model(**batch).loss - ref_loss(ref, batch, -2 * delta)[0]) < TOL, "stale weights"
    with torch.no_grad():
        assert abs(model(**batch).loss - ref_loss(ref, batch, 0 * delta)[0]) < TOL, "perturbation outlived serving"


def check_exceptions(model, ref, batch, layout, before: dict) -> None:
    """(d) also when ``serving`` is left by an exception or a KeyboardInterrupt."""
    theta = torch.cat(layout.base()) + 0.5
    for error in (RuntimeError, KeyboardInterrupt):
        try:
            with layout.serving(theta.split(layout.local_sizes)):
                model(**batch).loss  # forward with grad and no backward, then out
                raise error("boom")
        except error:
            pass
        check_unchanged(model, layout, before)
    with torch.no_grad():
        assert abs(model(**batch).loss - ref_loss(ref, batch, torch.zeros(layout.global_numel))[0]) < TOL


def check_refusals(world: int) -> None:
    """What the layout cannot serve is refused with a ValueError."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    seq = seq_of_two()
    fully_shard(seq[0])
    refused(seq, "not managed by FSDP")
    if world == 4:
        seq = seq_of_two()
        fully_shard(seq[0], reshard_after_forward=2)
        refused(fully_shard(seq), "reshard_after_forward given as an int")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        refused(fully_shard(seq_of_two(), mesh=mesh), "HSDP")
    refused(fully_shard(seq_of_two(), offload_policy=CPUOffloadPolicy(pin_memory=False)), "CPU offload")
    assert fsdp_state(torch.nn.Linear(2, 2)) is None


def seq_of_two() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()


def refused(model: torch.nn.Module, words: str) -> None:
    try:
        fsdp_state(model)
    except ValueError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{words} was accepted")


def check_workspace(model: torch.nn.Module, layout: ShardedLayout) -> None:
    """Every rank gets one workspace limit, the least of the ranks' rooms, so that all cut the heads alike: on a CPU
    (no free memory known) the default size; with free memory that differs per rank (a GPU's, simulated) the
    smallest rank's share of it."""
    placement, f32 = fsdp.FsdpPlacement(model, layout), torch.float32
    cpu = placement.workspace(layout.numel, f32)
    assert cpu.limit == cpu.entries == DEFAULT_ENTRIES, (cpu.limit, cpu.entries)
    real = fsdp.device_free_bytes
    fsdp.device_free_bytes = lambda device: (layout.rank + 1) << 30
    try:
        gpu = placement.workspace(layout.numel, f32)
    finally:
        fsdp.device_free_bytes = real
    limits: list[int | None] = [None] * layout.world
    dist.all_gather_object(limits, gpu.limit)
    least = workspace_room(layout.numel, layout.numel * f32.itemsize, 1 << 30) // f32.itemsize
    assert limits == [least] * layout.world and least > DEFAULT_ENTRIES, (limits, least)


def main(arch: str, shard1: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, batch, frozen = build(arch)
    ref = copy.deepcopy(model)
    frozen_index = [n for n, _ in model.named_parameters()].index(frozen)
    shard_model(model, placement=placement_fn(model) if shard1 else None)
    layout = fsdp_state(model)
    assert layout is not None and layout.world == dist.get_world_size() and layout.rank == dist.get_rank()
    assert layout.device == torch.device("cpu") and layout.names == [n for n, _ in ref.named_parameters()]
    assert layout.global_shapes == [p.shape for p in ref.parameters()]
    if shard1:  # the last column of a q weight lives on the last rank under Shard(1), on rank 0 under Shard(0)
        names = [n for n, _ in ref.named_parameters()]
        q = next(i for i, n in enumerate(names) if n.endswith(("query.weight", "q_proj.weight")))
        first = sum(p.numel() for p in list(ref.parameters())[:q])
        owner, _ = layout.localize(torch.tensor([first + layout.global_shapes[q][1] - 1]))
        assert owner.item() == layout.world - 1, owner
    model(**batch).loss.backward()  # the user's own gradients: measurement must leave them as they are
    before = snapshot(model, layout)
    owner, pos = check_localize(layout, ref)
    check_serving(model, ref, batch, layout, owner, pos, frozen_index)
    check_unchanged(model, layout, before)
    check_exceptions(model, ref, batch, layout, before)
    check_workspace(model, layout)
    total = layout.all_reduce(torch.tensor([layout.rank + 1.0], dtype=torch.float64))
    assert total.item() == layout.world * (layout.world + 1) / 2
    if arch == "bert" and not shard1:
        check_refusals(layout.world)
    dist.barrier()
    print(f"FSDP-WORKER-OK rank {layout.rank} local sizes {layout.local_sizes[-2:]}", flush=True)
    # Leave without the interpreter's shutdown: under load, gloo's threads sometimes abort it (SIGABRT, "terminate
    # called without an active exception") after all the work is done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], "--shard1" in sys.argv[2:])
