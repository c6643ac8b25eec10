"""Robustness of the leaderboard: a damaged store, two runs on one ``--out``, results reused only while the model and
the data are what they were, model lists that include themselves, bad settings and Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_geosharp import cli
from hf_geosharp.data import DataSpec
from hf_geosharp.leaderboard.store import LOCK_FILE, STORE_FILE, data_identity, model_identity, output_lock

from .fixtures.hf_models import one_thread, save_text_model, write_csv  # noqa: F401  (one_thread: autouse)

FAST = ["--n-examples", "8", "--batch-size", "4", "--steps", "2", "--quiet"]


@pytest.fixture()
def setup(tmp_path):
    model = save_text_model(tmp_path / "model")
    data = write_csv(tmp_path / "reviews.csv", 12)
    out = tmp_path / "board"

    def board(*extra: str, measures: str = "adaptive") -> int:
        return cli.main(["leaderboard", str(model), "--dataset", str(data), *FAST, "--measures", measures,
                         "--out", str(out), *extra])

    return {"model": model, "data": data, "out": out, "board": board, "store": out / STORE_FILE}


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in lines(path)]


def test_a_damaged_store_is_reported_and_the_rest_is_used(setup, caplog):
    assert setup["board"]() == 0
    good = records(setup["store"])
    measure = next(r for r in good if r["kind"] == "measure")
    stats = next(r for r in good if r["kind"] == "stats")
    no_value = {k: v for k, v in measure.items() if k != "value"}
    setup["store"].write_bytes(b"\n".join([
        json.dumps(stats).encode(), b"\xff\xfe\xfa not utf-8", b"{not json", json.dumps(no_value).encode(),
        json.dumps({"value": 1.0}).encode(),
    ]) + b"\n")
    caplog.clear()
    assert setup["board"]() == 0
    err = caplog.text  # a warning of hf_geosharp.leaderboard.store: the command line prints it on stderr
    assert ("skipped 4 damaged line(s) (line 2: not UTF-8; line 3: not JSON; line 4: no 'value'; line 5: no 'key')"
            in err and "recomputed" in err)
    after = [json.loads(line) for line in lines(setup["store"]) if _usable(line)]
    assert after[:1] == [stats]  # kept, not recomputed, and nothing was rewritten in place
    recomputed = after[-1]
    assert recomputed["kind"] == "measure" and recomputed["value"] == measure["value"]
    assert len(lines(setup["store"])) == 6  # five old lines (the damaged ones left for the user) + one new


@pytest.mark.parametrize("value", [float("nan"), None, "0.5", [0.5], {"v": 0.5}, True, float("inf")],
                         ids=["NaN", "null", "string", "list", "object", "true", "inf"])
def test_a_wrongly_typed_record_is_named_by_line_never_ranked_and_a_rerun_succeeds(setup, caplog, capsys, value):
    """A record whose ranked number is not a finite number (NaN would drop the model to last place; null, a string or
    a list must not fail the run at its end with "rerun to resume") is reported with file, line and reason, never
    ranked, and measured again; the next run reports the superseded line and which line to delete."""
    assert setup["board"]() == 0
    good = records(setup["store"])
    measure = next(r for r in good if r["kind"] == "measure")
    stats = next(r for r in good if r["kind"] == "stats")
    bad = {**measure, "value": value}
    setup["store"].write_text(json.dumps(stats) + "\n" + json.dumps(bad, allow_nan=True) + "\n")
    caplog.clear()
    assert setup["board"]("--quiet") == 0
    err = caplog.text
    assert str(setup["store"]) in err and "line 2: 'value' is " in err and "not a finite number" in err
    assert "recomputed" in err and "never ranked" in err
    table = (setup["out"] / "leaderboard.csv").read_text()
    assert repr(measure["value"]) in table  # the re-measured value is what is ranked, not the damaged one
    assert records(setup["store"])[-1]["value"] == measure["value"]
    caplog.clear()
    assert setup["board"]() == 0  # and every later run succeeds, naming the one line left to delete
    assert "line 2 already has a good record with the same key (delete that line" in caplog.text
    assert "rerun" not in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "field", "value", "reason"), [
    ("measure", "converged", None, "'converged' is null, not true or false"),
    ("measure", "stderr", "n/a", "'stderr' is a string \"n/a\", not a number"),
    ("stats", "param_norm", float("nan"), "'param_norm' is NaN, not a finite number"),
    ("stats", "clean_loss", [1.0], "'clean_loss' is a list [1.0], not a finite number"),
    ("splits", "test_loss", None, "'test_loss' is null, not a finite number"),
])
def test_every_field_read_from_a_record_is_type_checked(tmp_path, kind, field, value, reason, caplog):
    from hf_geosharp.leaderboard.store import REQUIRED, ResultStore

    record = {"key": "k", "kind": kind, **{name: 1.0 for name in REQUIRED[kind]}}
    ok = {**record, "key": "ok"}
    path = tmp_path / STORE_FILE
    path.write_text(json.dumps(ok) + "\n" + json.dumps({**record, field: value}, allow_nan=True) + "\n")
    store = ResultStore(path)
    assert store.get("k") is None and store.get("ok") == ok
    assert [(d.number, d.reason) for d in store.damaged] == [(2, reason)]
    assert f"line 2: {reason}" in caplog.text
    nan_error = {**record, "key": "regression", **({"test_error": float("nan")} if kind == "splits" else {})}
    path.write_text(json.dumps(nan_error, allow_nan=True) + "\n")  # NaN where it is meaningful is kept
    assert ResultStore(path).get("regression") is not None


def _usable(line: bytes) -> bool:
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:
        return False
    return isinstance(record, dict) and "key" in record and ("value" in record or record.get("kind") != "measure")


def test_a_second_run_on_the_same_out_fails_fast_naming_the_lock(setup, capsys):
    """Another process holds the lock: this run exits 2 at once, without computing anything."""
    setup["out"].mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from filelock import FileLock; "
         f"lock = FileLock({str(setup['out'] / LOCK_FILE)!r}); lock.acquire(); print('held', flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.perf_counter()
        assert setup["board"]("--steps", "500") == 2
        assert time.perf_counter() - start < 20
        err = capsys.readouterr().err
        assert LOCK_FILE in err and "another geosharp leaderboard" in err and "rerun" not in err
        assert not setup["store"].exists()
    finally:
        holder.kill()
        holder.wait()
    assert setup["board"]() == 0  # released when its holder dies


def test_the_lock_is_held_for_the_run_and_released_after(setup):
    with output_lock(setup["out"]):
        assert setup["board"]() == 2
    assert setup["board"]() == 0


def test_editing_the_data_or_the_config_recomputes(setup):
    assert setup["board"]() == 0
    first = records(setup["store"])
    assert setup["board"]() == 0
    assert records(setup["store"]) == first  # unchanged inputs: everything reused
    rows = list(csv.reader(setup["data"].read_text().splitlines()))
    flipped = [rows[0]] + [[text, str(1 - int(label))] for text, label in rows[1:]]
    os.utime(setup["data"], ns=(0, 0))
    stamp = setup["data"].stat().st_mtime_ns
    with setup["data"].open("w", newline="") as f:
        csv.writer(f).writerows(flipped)
    os.utime(setup["data"], ns=(stamp, stamp))  # same size and mtime: only the content tells
    assert setup["board"]() == 0
    after_data = records(setup["store"])
    assert len(after_data) == 2 * len(first)
    assert after_data[-1]["clean_loss"] != first[-1]["clean_loss"]  # new labels, new loss: not the old table
    config = json.loads((setup["model"] / "config.json").read_text())
    config["id2label"] = {"0": "negative", "1": "positive"}
    config["label2id"] = {"negative": 0, "positive": 1}
    (setup["model"] / "config.json").write_text(json.dumps(config))
    assert setup["board"]() == 0
    assert len(records(setup["store"])) == 3 * len(first)


def test_fingerprints_follow_content_not_names(tmp_path, monkeypatch):
    model = save_text_model(tmp_path / "model")
    key = model_identity(str(model))
    (model / "README.md").write_text("# a card does not change the results\n")
    assert model_identity(str(model)) == key
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_identity(str(model)) != key
    csv_path = write_csv(tmp_path / "a.csv", 6)
    spec = DataSpec(dataset=str(csv_path))
    before = data_identity(spec)
    csv_path.write_text(csv_path.read_text().replace(",1\n", ",0\n"))
    assert data_identity(spec) != before


def test_selecting_examples_writes_nothing_into_a_saved_dataset_and_keeps_its_identity(tmp_path):
    """A second run must find the same data key: datasets' shuffle on a dataset loaded from disk would write
    cache-*.arrow files into the folder, and a folder's key must not change with such files either."""
    from hf_geosharp.data import load_split, select_examples
    from hf_geosharp.zoo import export_digits

    folder = export_digits(tmp_path / "digits")
    spec = DataSpec(dataset=str(folder), split="train", n_examples=64, seed=3)
    before, files = data_identity(spec), sorted(folder.rglob("*"))
    chosen = select_examples(load_split(spec), spec)
    assert len(chosen) == 64 and chosen[0] != load_split(spec)[0]  # shuffled, yet
    assert sorted(folder.rglob("*")) == files  # nothing written beside the data
    (folder / "train" / "cache-0123456789abcdef.arrow").write_bytes(b"written by another tool")
    assert data_identity(spec) == before
    (folder / "train" / "extra.arrow").write_bytes(b"data")
    assert data_identity(spec) != before  # any other file is part of the data


def test_hub_ids_are_fingerprinted_by_their_revision(tmp_path, monkeypatch):
    """Offline, the revision comes from the local cache: the snapshot a Hub id resolves to."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--tiny"

    def cache(sha: str) -> None:
        (repo / "snapshots" / sha).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / sha / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(sha)

    cache("a" * 40)
    first = model_identity("someone/tiny")
    assert first["revision"] == "a" * 40
    cache("b" * 40)
    assert model_identity("someone/tiny")["revision"] == "b" * 40


def test_a_model_list_that_includes_itself_is_refused(setup, tmp_path, capsys):
    listing = tmp_path / "models.txt"
    other = tmp_path / "more.txt"
    listing.write_text(f"{setup['model']}\nmore.txt\n")
    other.write_text("models.txt\n")
    assert cli.main(["leaderboard", str(listing), "--dataset", str(setup["data"]), *FAST,
                     "--out", str(setup["out"])]) == 2
    err = capsys.readouterr().err
    assert "includes itself" in err and "more.txt -> " in err


@pytest.mark.parametrize("argv", [["--rho", "-1"], ["--steps", "0"], ["--seed", "-1"], ["--epsilon", "nan"]])
def test_bad_settings_are_usage_errors_without_resume_advice(setup, capsys, argv):
    with pytest.raises(SystemExit) as info:
        setup["board"](*argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and argv[0] in err and "rerun" not in err and "Traceback" not in err


def test_epsilon_zero_is_accepted(setup):
    assert setup["board"]("--epsilon", "0", measures="inv") == 0


def test_ctrl_c_keeps_finished_results_and_says_where(setup, monkeypatch, capsys):
    from hf_geosharp.pipeline import Prepared  # the leaderboard measures each column with Prepared.measure_one

    real, calls = Prepared.measure_one, []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(Prepared, "measure_one", interrupted_second)
    assert setup["board"](measures="inv,adaptive") == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C); finished results are kept in" in err and "Traceback" not in err
    assert [r["measure"] for r in records(setup["store"])] == ["geodesic_inv_worst"]
    monkeypatch.setattr(Prepared, "measure_one", real)
    assert setup["board"](measures="inv,adaptive") == 0  # resumes: the finished measure is not recomputed
    measures = [r.get("measure") for r in records(setup["store"])]
    assert measures[0] == "geodesic_inv_worst" and measures[1].startswith("adaptive_")
    assert measures.count("geodesic_inv_worst") == 1


# ------------------------------------------------------------------------------------- errors name their model
def _nan_weights(folder: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.self.query.weight[0, 0] = float("nan")
    model.save_pretrained(folder)


def test_a_model_that_cannot_be_measured_is_named_and_no_rerun_is_advised(setup, tmp_path, capsys):
    """One model of the list with a NaN weight: exit 2, the message names the model and the parameter, says the
    other models' results are kept and does not advise the rerun that would fail again; without that model the rerun
    succeeds and reuses what was measured."""
    bad = save_text_model(tmp_path / "broken-bert", seed=1)
    _nan_weights(bad)
    argv = ["leaderboard", str(setup["model"]), str(bad), "--dataset", str(setup["data"]), *FAST,
            "--measures", "adaptive", "--out", str(setup["out"])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "model 'broken-bert'" in err and "bert.encoder.layer.0.attention.self.query.weight" in err
    assert "NaN" in err and "remove it from the model list" in err and "rerun the same command" not in err
    assert "kept in" in err
    measured = records(setup["store"])
    assert {r["model"] for r in measured} == {"model"}  # the good model's results, none of the broken one
    assert cli.main([a for a in argv if a != str(bad)]) == 0
    assert records(setup["store"]) == measured  # reused, not measured again


def _meta_position_ids(model):
    model.bert.embeddings.register_buffer(
        "position_ids", torch.empty_like(model.bert.embeddings.position_ids, device="meta"), persistent=False)
    return model


def test_a_buffer_on_the_meta_device_is_named_before_the_work(setup, monkeypatch, capsys):
    from hf_geosharp.leaderboard import run as board_run

    load = board_run.load  # the pipeline's loader, as the leaderboard calls it
    monkeypatch.setattr(board_run, "load", lambda *a, **k: _meta_position_ids(load(*a, **k)))
    assert setup["board"]() == 2
    err = capsys.readouterr().err
    assert "model 'model'" in err and "'bert.embeddings.position_ids' is on the meta device" in err
    assert "index out of range" not in err and "rerun the same command" not in err
    assert not setup["store"].exists() or records(setup["store"]) == []


def test_meta_and_nan_buffers_are_refused_by_the_api_before_the_work():
    """The engine's own check: a meta buffer and a NaN BatchNorm running variance are blamed on the buffer, by name,
    before any work (not "index out of range in self", not "check the inputs and labels"); the model untouched."""
    import hf_geosharp as gs

    from .fixtures.hf_models import tiny_bert

    model = _meta_position_ids(tiny_bert())
    batch = {"input_ids": torch.randint(0, 100, (2, 6)), "labels": torch.tensor([0, 1])}
    with pytest.raises(ValueError, match=r"buffer 'bert.embeddings.position_ids' is on the meta device"):
        gs.geodesic_sharpness(model, [batch], steps=1, progress=False)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.linear(x))

    net = Net().eval()
    net.bn.running_var[1] = float("nan")
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    data = [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))]
    with pytest.raises(ValueError, match=r"buffer 'bn.running_var' holds NaN") as info:
        gs.adaptive_sharpness(net, data, loss_fn=loss_fn, steps=1, progress=False)
    assert "inputs and labels" not in str(info.value) and "reset_running_stats" in str(info.value)
    torch.testing.assert_close(dict(net.state_dict()), before, rtol=0, atol=0, equal_nan=True)
