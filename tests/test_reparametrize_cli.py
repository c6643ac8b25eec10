"""``geosharp reparametrize MODEL OUT``: a transformed copy with the same function; MODEL and other folders
untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

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


@pytest.mark.parametrize("condition", ["0.5", "nan"])
def test_bad_condition(tmp_path: Path, condition: str, capsys) -> None:
    model_dir = save_text_model(tmp_path / "model")
    assert main(["reparametrize", str(model_dir), str(tmp_path / "o"), "--condition", condition]) == 2
    assert "--condition" in capsys.readouterr().err
