"""The FSDP2 layout (``hf_geosharp.engine.placement.fsdp_layout``): each check runs ``tests/fsdp_worker.py`` under
``torchrun`` on CPU with gloo, on a tiny float64 BERT (3 labels, so the head is sharded unevenly, with empty shards over
4 ranks) and a tiny Llama with GQA and RoPE, against an unsharded copy of the same model. The worker checks, on every
rank: the shards placed by ``localize`` rebuild every parameter exactly; the loss under ``serving`` equals the unsharded
loss at the perturbed weights, also after ``theta`` moved in place; ``stream_gradients`` gives the local pieces of the
unsharded gradient, zeros for a frozen parameter; every rank gets the same workspace limit; shards, ``.grad``,
``requires_grad`` and modes are unchanged afterwards, also after an exception or a KeyboardInterrupt inside
``serving``; unsupported setups are refused."""

from __future__ import annotations

import ast
import re
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


PLACEMENT = ROOT / "hf_geosharp" / "engine" / "placement"


@pytest.mark.parametrize("module, package_imports", [("fsdp_layout", {"space.coordinates", "fsdp_internals"}),
                                                     ("fsdp_internals", set()), ("sharding", {"fsdp_layout"})])
def test_the_layer_imports_only_torch(module, package_imports):
    """The layer sits under the engine: no transformers or accelerate, and of the package only the pure-torch
    coordinates module (where pair factors live in a flat vector) and the adapter of FSDP's internals for the layout,
    and the layout for the sharding helpers."""
    tree = ast.parse((PLACEMENT / f"{module}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    third_party = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"torch"}, imported
    assert relative == package_imports, relative


#: FSDP2 internals (attributes of its modules, states, parameter groups, parameters and DTensors) the engine may use
#: in ``fsdp_internals.py`` only.
PRIVATE = re.compile(r"\._(get_fsdp_state|lazy_init|is_root|fsdp_param_groups?|sharded_param_data|unsharded_param|"
                     r"local_tensor|param_fqn|orig_size|sharded_local_tensor|reset_sharded_param)\b|"
                     r"\b(offload_to_cpu|post_forward_mesh_info|padded_sharded_param_size|fsdp_placement|fsdp_params)\b"
                     r"|_fully_shard\b")


def test_fsdp_internals_are_used_in_one_adapter_only():
    """Every use of a private FSDP2 name is in ``fsdp_internals.py`` (at most 150 lines, which says why each has no
    public route); the rest of the package reaches FSDP2 through its public API."""
    adapter = PLACEMENT / "fsdp_internals.py"
    users = {str(path.relative_to(ROOT)) for path in (ROOT / "hf_geosharp").rglob("*.py")
             if path != adapter and PRIVATE.search(path.read_text())}
    assert users == set()
    assert PRIVATE.search(adapter.read_text()) and len(adapter.read_text().splitlines()) <= 150


def test_a_torch_without_the_fsdp_internals_is_refused_with_the_supported_range(monkeypatch):
    from hf_geosharp.engine.placement import fsdp_internals

    fsdp_internals.check_torch.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    try:
        with pytest.raises(RuntimeError, match=r"torch >= 2\.11"):
            fsdp_internals.check_torch()
    finally:
        fsdp_internals.check_torch.cache_clear()


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
