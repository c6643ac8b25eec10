"""Two CPU processes (gloo) give the one-process result: through ``torchrun -m hf_geosharp run`` and through the
evaluate module, where every rank calls ``compute`` on its own shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import evaluate
import pytest
from accelerate import debug_launcher

import hf_geosharp as gs
from hf_geosharp import cli

from .fixtures.hf_models import one_thread, save_text_model, sentences, tiny_bert, tiny_tokenizer, write_csv  # noqa: F401

SETTINGS = dict(rho=0.05, steps=3, seed=0)


def _values(report: dict) -> dict[str, list[float]]:
    return {name: [res["value"], *res["per_batch"]] for name, res in report["results"].items()}


def test_torchrun_two_processes_match_one_process(tmp_path, capsys):
    model, data = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "reviews.csv", 30)
    argv = ["run", "--model", str(model), "--dataset", str(data), "--n-examples", "15", "--batch-size", "4",
            "--steps", "3", "--rho", "0.05"]  # fmt: skip  # 4 batches: 2 per process
    assert cli.main([*argv, "--quiet", "--json", str(tmp_path / "one.json")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*launch, "-m", "hf_geosharp", *argv, "--json", str(tmp_path / "two.json")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert all(r["config"]["n_processes"] == 2 for r in two["results"].values())
    got, expected = _values(two), _values(one)
    assert list(got) == list(expected)
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-6), name
    assert proc.stdout.count("measure ") == 1  # only rank 0 prints the table


def _compute_on_my_shard(module, data: dict, out_dir: str) -> None:
    """One rank, as the measurement card shows it: its contiguous share of the examples, the same keywords."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    n = len(data["labels"])
    with accelerator.split_between_processes(dict(data)) as shard:  # (it splits the dict it is given in place)
        assert 0 < len(shard["labels"]) < n
    out = module.compute(
        model=tiny_bert(), **shard, batch_size=3, metric="inv,mix", accelerator=accelerator, **SETTINGS
    )
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({k: v for k, v in out.items() if k != "config"} | {"world_size": out["config"]["world_size"]}, f)


def _launch_two_ranks(data_path: str, out_dir: str) -> None:
    """Run in a fresh interpreter: ``debug_launcher`` forks, and forking a process whose OpenMP pool is already
    running (as it is after earlier tests) can deadlock the children."""
    data = json.loads(open(data_path).read())
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)
    debug_launcher(lambda: _compute_on_my_shard(module, data, out_dir), num_processes=2)


def test_evaluate_compute_on_shards_matches_one_process(tmp_path):
    texts, labels = sentences(11, seed=2)
    enc = tiny_tokenizer(tmp_path / "tok")(texts, truncation=True)
    data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)
    one = module.compute(model=tiny_bert(), **data, batch_size=3, metric="inv,mix", **SETTINGS)

    (tmp_path / "data.json").write_text(json.dumps(data))
    script = (
        "from tests.test_distributed import _launch_two_ranks; "
        f"_launch_two_ranks({str(tmp_path / 'data.json')!r}, {str(tmp_path)!r})"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["world_size"] == 2 and one["config"]["world_size"] == 1
    for key in ("geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness", "clean_loss"):
        assert ranks[0][key] == pytest.approx(one[key], rel=1e-6), key
        assert ranks[0][f"{key}_per_batch"] == pytest.approx(one[f"{key}_per_batch"], rel=1e-6), key
    assert len(one["clean_loss_per_batch"]) == 4  # 11 examples in batches of 3: shards were joined before batching
