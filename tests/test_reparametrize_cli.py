"""``geosharp reparametrize MODEL OUT``: a transformed copy with the same function; MODEL and other folders
untouched."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import transformers as tf

from hf_geosharp import durable
from hf_geosharp.cli import main
from tests.fixtures.hf_models import save_text_model, tiny_tokenizer, write_csv


def _logits(folder: Path, texts: list[str]) -> torch.Tensor:
    model = tf.BertForSequenceClassification.from_pretrained(folder).eval()
    enc = tiny_tokenizer(folder)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


TEXTS = ["good film", "awful plot was dull", "the actor is great fun"]


def test_random_copy_keeps_the_function_and_leaves_model_alone(tmp_path: Path, capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    before = _tree(model_dir)
    out = tmp_path / "out"
    assert main(["reparametrize", str(model_dir), str(out), "--condition", "100", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "function check" in printed
    assert _tree(model_dir) == before  # MODEL is never written
    a, b = _logits(model_dir, TEXTS), _logits(out, TEXTS)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()  # float32 weights: round-off of a condition-100 element
    q = "bert.encoder.layer.0.attention.self.query.weight"
    w0 = tf.BertForSequenceClassification.from_pretrained(model_dir).state_dict()[q]
    w1 = tf.BertForSequenceClassification.from_pretrained(out).state_dict()[q]
    assert (w0 - w1).abs().max() > 1e-2 * w0.abs().max()
    record = json.loads((out / "geosharp_reparametrize.json").read_text())
    assert record["seed"] == 3 and record["max_output_deviation"] < 1e-4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_refuses_model_itself_and_non_empty_out(tmp_path: Path, capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    before = _tree(model_dir)
    assert main(["reparametrize", str(model_dir), str(model_dir)]) == 2
    assert "never written" in capsys.readouterr().err
    assert main(["reparametrize", str(model_dir), str(model_dir / "sub")]) == 2
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["reparametrize", str(model_dir), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["reparametrize", str(model_dir), str(tmp_path / "x"), "--hide", "sharp"]) == 2
    assert "--dataset" in capsys.readouterr().err
    assert _tree(model_dir) == before
    assert main(["reparametrize", str(model_dir), str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()


def test_hide_sharp_copy(tmp_path: Path, capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    data = write_csv(tmp_path / "data.csv", 16)
    out = tmp_path / "out"
    code = main(["reparametrize", str(model_dir), str(out), "--hide", "sharp", "--dataset", str(data),
                 "--n-examples", "16", "--batch-size", "8"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "adaptive sharpness" in printed
    record = json.loads((out / "geosharp_reparametrize.json").read_text())
    assert record["hide"] == "sharp" and record["value_after"] > record["value_before"]
    a, b = _logits(model_dir, TEXTS), _logits(out, TEXTS)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_hide_at_its_defaults_moves_adaptive_sharpness_tenfold_on_the_readme_model(tmp_path: Path, capsys) -> None:
    """The README's tiny BERT (float64, seed 0): --hide sharp at its default condition moves adaptive sharpness by
    x10 or more; at --condition 100 it barely moves, and the command says so and which option moves it further."""
    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           vocab_size=100)
    model_dir = tmp_path / "model"
    tf.BertForSequenceClassification(config).double().save_pretrained(model_dir)
    tiny_tokenizer(tmp_path / "tok").save_pretrained(model_dir)
    data = write_csv(tmp_path / "data.csv", 32)
    argv = ["reparametrize", str(model_dir), str(tmp_path / "out"), "--hide", "sharp", "--dataset", str(data)]
    factors = {}
    for condition in ([], ["--condition", "100"]):
        assert main([*argv, *condition, "--overwrite"]) == 0
        record = json.loads((tmp_path / "out" / "geosharp_reparametrize.json").read_text())
        factors[record["condition"]] = record["factor"], capsys.readouterr().out
    (default, (moved, said)), (_, (barely, hint)) = factors.items()
    assert default > 100 and moved >= 10 and "a larger one" not in said
    assert barely < moved and f"moved by x{barely:.3g} only at --condition 100; a larger one" in hint


@pytest.mark.parametrize("condition", ["0.5", "nan"])
def test_bad_condition(tmp_path: Path, condition: str, capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    assert main(["reparametrize", str(model_dir), str(tmp_path / "o"), "--condition", condition]) == 2
    assert "--condition" in capsys.readouterr().err


def _interrupt_at(monkeypatch, module, name: str) -> None:
    """A real Ctrl-C (SIGINT) as ``module.name`` is called: the signal handler, not the call, raises."""
    real = getattr(module, name)

    def call(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, call)


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("where", ["while saving", "at the swap", "at the rename"])
def test_ctrl_c_leaves_out_old_or_new_complete_and_says_which(tmp_path: Path, monkeypatch, capsys, where) -> None:
    """Ctrl-C during ``--overwrite``: OUT is byte for byte the old copy (interrupted while the new one is written)
    or the new one (interrupted as it goes in: the swap finishes first), never missing, and the one line says
    which. Nothing hidden is left next to OUT."""
    model_dir = save_text_model(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["reparametrize", str(model_dir), str(out), "--seed", "1"]) == 0
    old = _tree(out)
    if where == "while saving":
        _interrupt_at(monkeypatch, tf.PreTrainedModel, "save_pretrained")
    elif where == "at the swap":
        _interrupt_at(monkeypatch, durable, "_exchange")
    else:  # no atomic exchange on this file system: the two renames
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
        _interrupt_at(monkeypatch, os, "rename")
    capsys.readouterr()
    assert main(["reparametrize", str(model_dir), str(out), "--seed", "2", "--overwrite"]) == 130
    err = capsys.readouterr().err.strip()
    monkeypatch.undo()
    if where == "while saving":
        assert _tree(out) == old and err == f"interrupted (Ctrl-C); nothing was written ({out} is as it was)."
    else:
        assert main(["reparametrize", str(model_dir), str(tmp_path / "fresh"), "--seed", "2"]) == 0
        assert _tree(out) == _tree(tmp_path / "fresh") != old
        assert err == f"interrupted (Ctrl-C); the new copy in {out} is complete."
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", "out"] + (["fresh"] if where != "while saving"
                                                                                   else []))


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_before_out_exists_leaves_no_out_and_out_follows_the_umask(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    out = tmp_path / "new" / "out"
    _interrupt_at(monkeypatch, tf.PreTrainedModel, "save_pretrained")
    assert main(["reparametrize", str(model_dir), str(out)]) == 130
    assert "nothing was written." in capsys.readouterr().err
    assert not out.exists()  # the path check created nothing
    monkeypatch.undo()
    previous = os.umask(0o022)
    try:
        assert main(["reparametrize", str(model_dir), str(out)]) == 0
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
