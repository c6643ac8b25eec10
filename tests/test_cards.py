"""Model-card entries: round trip through ModelCard.load, preserved content, no duplicates, offline --push."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, ModelCardData, constants, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results

from hf_geosharp import __version__, cli
from hf_geosharp.cards import METRIC_TYPE, CardError, DatasetInfo, eval_result, push_card, read_results

EXISTING = """---
license: mit
tags:
- vision
model-index:
- name: my-vit
  results:
  - task:
      type: image-classification
    dataset:
      name: digits
      type: digits
      split: test
    metrics:
    - type: accuracy
      value: 0.97
---

# my-vit

A small ViT. **Do not lose this sentence.**

## Training

Trained for 10 epochs.
"""


def _result(measure: str, value: float, rho: float = 0.1, **config) -> dict:
    geodesic = measure.startswith("geodesic")
    base = {"rho": rho, "mode": "worst", "steps": 20, "seed": 0, "n_samples": 20, "params": "all", "n_batches": 2}
    base.update({"metric": measure.split("_")[1], "epsilon": 1e-6} if geodesic else {"variant": "as23"})
    return {"measure": measure, "value": value, "per_batch": [value, value], "clean_loss": 0.3,
            "per_batch_clean_loss": [0.3, 0.3], "config": {**base, **config}}


def _run_json(path: Path, *results: dict) -> Path:
    """What `geosharp run --json` writes."""
    payload = {"hf_geosharp_version": __version__, "model": "my-vit", "model_class": "ViTForImageClassification",
               "data": {"dataset": "digits", "config": None, "split": "train", "n_examples": 64, "batch_size": 32,
                        "seed": 0},
               "results": {r["measure"]: r for r in results}}
    path.write_text(json.dumps(payload))
    return path


def _ours(path: Path) -> list:
    return [r for r in ModelCard.load(path).data.eval_results if r.metric_type == METRIC_TYPE]


def test_card_round_trip_keeps_content_and_replaces_the_same_config(tmp_path, capsys):
    readme = tmp_path / "my-vit" / "README.md"
    readme.parent.mkdir()
    readme.write_text(EXISTING)
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.25), _result("adaptive_as23_worst", 0.05))
    assert cli.main(["card", str(readme.parent), "--results", str(run)]) == 0
    assert "- name: my-vit" in capsys.readouterr().out  # the snippet names the model as the card does

    card = ModelCard.load(readme)
    assert "**Do not lose this sentence.**" in card.text and "Trained for 10 epochs." in card.text
    assert card.data.license == "mit" and card.data.tags == ["vision"] and card.data.model_name == "my-vit"
    assert [r.metric_type for r in card.data.eval_results] == ["accuracy", METRIC_TYPE, METRIC_TYPE]
    inv = next(r for r in card.data.eval_results if r.metric_config == "geodesic_inv_worst")
    assert inv.metric_value == 0.25 and inv.task_type == "image-classification"
    assert (inv.dataset_type, inv.dataset_split, inv.dataset_args) == ("digits", "train",
                                                                     {"n_examples": 64, "batch_size": 32, "seed": 0})
    assert inv.metric_args == {"rho": 0.1, "metric": "inv", "mode": "worst", "steps": 20, "seed": 0, "n_batches": 2,
                               "epsilon": 1e-6}
    assert inv.source_name == f"hf_geosharp {__version__}" and inv.source_url

    # the YAML validates locally: the model-index parses back into exactly these results
    name, parsed = model_index_to_eval_results(metadata_load(readme)["model-index"])
    assert name == "my-vit" and parsed == card.data.eval_results
    ModelCardData(**metadata_load(readme))  # raises on malformed card data

    # the same configuration again: replaced, not duplicated
    rerun = _run_json(tmp_path / "rerun.json", _result("geodesic_inv_worst", 0.5), _result("adaptive_as23_worst", 0.05))
    assert cli.main(["card", str(readme), "--results", str(rerun)]) == 0
    ours = _ours(readme)
    assert len(ours) == 2 and next(r for r in ours if r.metric_config == "geodesic_inv_worst").metric_value == 0.5
    assert "**Do not lose this sentence.**" in ModelCard.load(readme).text

    # another rho is another measurement: added beside the first
    other = _run_json(tmp_path / "other.json", _result("geodesic_inv_worst", 0.9, rho=0.5))
    assert cli.main(["card", str(readme), "--results", str(other)]) == 0
    assert sorted(r.metric_args["rho"] for r in _ours(readme) if r.metric_config == "geodesic_inv_worst") == [0.1, 0.5]


def test_ablations_and_average_case_are_part_of_the_config():
    data = DatasetInfo(type="digits", name="digits", split="train")
    plain = eval_result(_result("geodesic_mix_worst", 1.0), data, "image-classification")
    ablated = eval_result(_result("geodesic_mix_worst", 1.0, second_order=False), data, "image-classification")
    assert "second_order" not in plain.metric_args and ablated.metric_args["second_order"] is False
    average = eval_result(_result("geodesic_inv_average", 1.0, mode="average"), data, "image-classification")
    assert average.metric_args["n_samples"] == 20 and "steps" not in average.metric_args


def test_new_card_is_created_and_bad_results_are_refused(tmp_path, capsys):
    results = tmp_path / "api.json"  # SharpnessResult.to_dict() output: no dataset recorded
    results.write_text(json.dumps([_result("geodesic_inv_worst", 0.1)]))
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(results)]) == 2
    assert "--dataset" in capsys.readouterr().err and not (tmp_path / "model").exists()
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(results), "--dataset", "glue:sst2",
                     "--split", "validation", "--task-type", "text-classification"]) == 0
    (entry,) = ModelCard.load(tmp_path / "model" / "README.md").data.eval_results
    assert (entry.dataset_type, entry.dataset_config, entry.dataset_split) == ("glue", "sst2", "validation")
    assert "model-index:" in capsys.readouterr().out

    (tmp_path / "empty.json").write_text(json.dumps({"results": {}}))
    with pytest.raises(CardError, match="no sharpness results"):
        read_results(tmp_path / "empty.json")


def test_push_offline_fails_clearly_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = []
    monkeypatch.setattr(ModelCard, "push_to_hub", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(ModelCard, "load", classmethod(lambda *a, **k: calls.append(k)))
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.25))
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(run), "--push", "me/my-vit"]) == 2
    err = capsys.readouterr().err
    assert "offline" in err and "HF_HUB_OFFLINE" in err and "me/my-vit" in err
    assert calls == [] and not (tmp_path / "model").exists()


def test_push_opens_a_pull_request_with_the_merged_card(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    pushed = {}

    def fake_load(cls, repo_id, **kwargs):
        pushed["loaded"] = repo_id
        return ModelCard(EXISTING)

    def fake_push(card, repo_id, **kwargs):
        pushed.update(card=card, repo_id=repo_id, **kwargs)
        return "https://huggingface.co/me/my-vit/discussions/1"

    monkeypatch.setattr(ModelCard, "load", classmethod(fake_load))
    monkeypatch.setattr(ModelCard, "push_to_hub", fake_push)
    entry = eval_result(_result("geodesic_inv_worst", 0.25), DatasetInfo("digits", "digits", "train"),
                        "image-classification")
    url = push_card("me/my-vit", [entry], token="hf_secret")
    assert url.endswith("/discussions/1") and pushed["loaded"] == "me/my-vit"
    assert pushed["create_pr"] is True and pushed["token"] == "hf_secret"
    assert [r.metric_type for r in pushed["card"].data.eval_results] == ["accuracy", METRIC_TYPE]
    assert "Do not lose this sentence." in pushed["card"].text
