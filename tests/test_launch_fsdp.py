"""The sharded launch paths give the one-process numbers: ``torchrun -m hf_geosharp run --fsdp`` and ``accelerate
launch --config_file examples/accelerate_fsdp2.yaml -m hf_geosharp run`` (every rank loads the model and all batches;
rank 0 alone prints and writes) and the evaluate module with ``fsdp=True`` (every rank passes its own share of the
examples). Both run two CPU ranks with gloo; the misuse cases (no launcher, a model the caller
passed unsharded) fail at once with a message that says what to do.

Run as ``torchrun --nproc_per_node 2 -m tests.test_launch_fsdp DATA MODEL OUT``, this module is one rank of the
evaluate check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import evaluate
import numpy as np
import pytest

import hf_geosharp as gs
from hf_geosharp import cli

from .fixtures.hf_models import one_thread, save_text_model, sentences, tiny_bert, tiny_tokenizer, write_csv  # noqa: F401
from .fixtures.torchrun import offline_env

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(rho=0.05, steps=3, seed=0)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def model_loss(model, batch):
    """The model's own loss, as a custom ``loss_fn`` (the engine then cannot assume a mean over examples)."""
    return model(**batch).loss


def _values(report: dict) -> dict[str, list[float]]:
    return {name: [res["value"], res["clean_loss"], *res["per_batch"]] for name, res in report["results"].items()}


LAUNCHERS = {  # the sharded launch paths of `geosharp run`: torchrun with --fsdp, accelerate with an FSDP config
    "torchrun": [*TORCHRUN, "-m", "hf_geosharp"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "examples" / "accelerate_fsdp2.yaml"), "--num_processes", "2", "-m", "hf_geosharp"],
}  # fmt: skip


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_sharded_run_matches_one_process_and_writes_once(launcher, tmp_path):
    model, data = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "reviews.csv", 20)
    argv = ["run", "--model", str(model), "--dataset", str(data), "--n-examples", "10", "--batch-size", "4",
            "--steps", "3", "--rho", "0.05", "--dtype", "float64"]  # fmt: skip  # 3 batches, the last one short
    assert cli.main([*argv, "--quiet", "--json", str(tmp_path / "one.json")]) == 0
    out = tmp_path / "results"
    flag = ["--fsdp"] if launcher == "torchrun" else []  # the accelerate config says FSDP itself
    proc = subprocess.run([*LAUNCHERS[launcher], *argv, *flag, "--output-path", str(out)], cwd=ROOT, env=offline_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = list(out.rglob("*.json"))
    assert len(written) == 1, written  # rank 0 alone writes
    assert proc.stdout.count("measure ") == 1 and "(FSDP2-sharded)" in proc.stdout  # rank 0 alone prints
    one, two = json.loads((tmp_path / "one.json").read_text()), json.loads(written[0].read_text())
    assert two["world_size"] == 2 and two["fsdp"] is True and one["fsdp"] is False
    assert two["config"]["model_class"] == one["config"]["model_class"] == "BertForSequenceClassification"
    assert two["config"]["dtype"] == "torch.float64"
    assert all(r["config"]["n_processes"] == 2 for r in two["results"].values())
    got, expected = _values(two), _values(one)
    assert list(got) == list(expected) == ["geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness"]
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-6), name


def test_fsdp_without_a_distributed_launch_is_bad_usage(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    argv = ["run", "--model", str(tmp_path / "nothing-loaded"), "--dataset", str(tmp_path / "none.csv"), "--fsdp"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "distributed launch" in err and "torchrun --nproc_per_node N -m hf_geosharp run --fsdp" in err


def test_evaluate_fsdp_misuse_says_what_to_do(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    texts, labels = sentences(4)
    enc = tiny_tokenizer(tmp_path / "tok")(texts)
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)
    inputs = dict(input_ids=enc["input_ids"], labels=labels, steps=1)
    with pytest.raises(ValueError, match="never modifies a model it is given"):
        module.compute(model=tiny_bert(), fsdp=True, **inputs)
    with pytest.raises(ValueError, match="fsdp=True needs a distributed launch.*torchrun"):
        module.compute(model_id=str(save_text_model(tmp_path / "bert")), fsdp=True, **inputs)


def test_evaluate_fsdp_on_shards_matches_one_process(tmp_path):
    texts, labels = sentences(11, seed=2)
    model = tmp_path / "bert64"  # float64: the shares' forwards round like the whole batch's to 1e-6
    tiny_bert().double().save_pretrained(model)
    tiny_tokenizer(model).save_pretrained(model)
    data = {"predictions": texts, "labels": labels}
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)
    one = module.compute(model_id=str(model), **data, batch_size=3, **SETTINGS)
    own = module.compute(model_id=str(model), **data, batch_size=3, loss_fn=model_loss, **SETTINGS)
    (tmp_path / "data.json").write_text(json.dumps(data))
    args = [str(tmp_path / "data.json"), str(model), str(tmp_path)]
    proc = subprocess.run([*TORCHRUN, "-m", "tests.test_launch_fsdp", *args], cwd=ROOT, env=offline_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # the engine was given shares (it tells them from identical batches by fingerprints) and
        log = rank.pop("engine_log")  # left out the embedding rows that no rank's share looks up
        shares = "FSDP over 2 ranks: each rank has its share of every batch"
        assert [m for m in log if m.startswith("FSDP")] == [shares] * 3
        assert sum(m.startswith("embedding rows held") for m in log) == 3, log
    assert ranks[0] == ranks[1] and ranks[0]["config"]["world_size"] == 2 and ranks[0]["config"]["fsdp"] is True
    assert ranks[0]["config"]["n_batches"] == one["config"]["n_batches"] == 4  # 11 examples in batches of 3
    users = [json.loads((tmp_path / f"user{r}.json").read_text()) for r in (0, 1)]
    assert users[0] == users[1] and users[0]["config"]["fsdp"] is True
    for key in ("geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness", "clean_loss"):
        for got, expected in ((ranks[0], one), (users[0], own)):
            assert got[key] == pytest.approx(expected[key], rel=1e-6), key
            assert got[f"{key}_per_batch"] == pytest.approx(expected[f"{key}_per_batch"], rel=1e-6), key


def _evaluate_rank(data_path: str, model: str, out_dir: str) -> None:
    """One rank: its contiguous share of the examples (uneven: 6 and 5) and the one-process keywords, with
    ``fsdp=True`` and then with a model the rank sharded itself."""
    import logging

    import torch.distributed as dist

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    for name in ("hf_geosharp.engine.placement.fsdp", "hf_geosharp.engine.builder"):  # the shares, the rows held
        engine = logging.getLogger(name)
        engine.addHandler(handler)
        engine.setLevel(logging.INFO)
    data = json.loads(Path(data_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = np.array_split(np.arange(len(data["labels"])), world)[rank].tolist()
    share = {k: [v[i] for i in rows] for k, v in data.items()}
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)
    out = module.compute(model_id=model, **share, batch_size=3, fsdp=True, **SETTINGS)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({**out, "engine_log": seen}))
    from transformers import AutoTokenizer

    from hf_geosharp.engine.placement.sharding import shard_model

    mine = shard_model(tiny_bert().double())  # sharded by the caller: measured sharded without the flag
    out = module.compute(model=mine, tokenizer=AutoTokenizer.from_pretrained(model), **share, batch_size=3,
                         loss_fn=model_loss, **SETTINGS)  # fmt: skip
    Path(out_dir, f"user{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's shutdown, which gloo's threads can abort under load


if __name__ == "__main__":
    _evaluate_rank(*sys.argv[1:4])
