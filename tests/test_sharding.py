"""The FSDP2 layout (``hf_geosharp.engine.placement.sharding``): each check runs ``tests/fsdp_worker.py`` under
``torchrun`` on CPU with gloo, on a tiny float64 BERT (3 labels, so the head is sharded unevenly, with empty shards over
4 ranks) and a tiny Llama with GQA and RoPE, against an unsharded copy of the same model. The worker checks, on every
rank: the shards placed by ``localize`` rebuild every parameter exactly; the loss under ``serving`` equals the unsharded
loss at the perturbed weights, also after ``theta`` moved in place; ``stream_gradients`` gives the local pieces of the
unsharded gradient, zeros for a frozen parameter; shards, ``.grad``, ``requires_grad`` and modes are unchanged
afterwards, also after an exception or a KeyboardInterrupt inside ``serving``; unsupported setups are refused."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_geosharp.engine.placement.fsdp_layout import fsdp_state

from .fixtures.torchrun import torchrun

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(nproc, str(ROOT / "tests" / "fsdp_worker.py"), *args, timeout=240)


CASES = {  # ranks, model, Shard(1) for the q/k/v weights
    "bert-2": (2, "bert", False),
    "bert-4": (4, "bert", False),
    "llama-2": (2, "llama", False),
    "llama-4": (4, "llama", False),
    "bert-2-shard1-qkv": (2, "bert", True),
    "llama-4-shard1-qkv": (4, "llama", True),
}


@pytest.mark.parametrize("nproc, arch, shard1", list(CASES.values()), ids=list(CASES))
def test_sharded_layout_matches_the_unsharded_model(nproc, arch, shard1):
    proc = _torchrun(nproc, arch, *(["--shard1"] if shard1 else []))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stdout.count("FSDP-WORKER-OK") == nproc


def test_a_model_without_fsdp_has_no_layout():
    assert fsdp_state(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())) is None


@pytest.mark.parametrize("module, package_imports", [("shard_layout", {"coordinates"}), ("sharding", {"shard_layout"})])
def test_the_layer_imports_only_torch(module, package_imports):
    """The layer sits under the engine: no transformers or accelerate, and of the package only the pure-torch
    coordinates module (where pair factors live in a flat vector), and the layout for the sharding helpers."""
    tree = ast.parse((ROOT / "hf_geosharp" / f"{module}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    third_party = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"torch"}, imported
    assert relative == package_imports, relative


def test_the_accelerate_fsdp2_config_parses_into_an_fsdp2_plugin(monkeypatch):
    """The shipped config read the way ``accelerate launch`` reads it: launch arguments, the environment handed to
    the processes, and the FSDP plugin an ``Accelerator`` builds from that environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    config = str(ROOT / "examples" / "accelerate_fsdp2.yaml")
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", config, "x.py"]))
    assert args.use_fsdp and args.num_processes == 2 and defaults.distributed_type.value == "FSDP"
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # the no-offload policy, which the layer accepts
