"""Publishing: model-index entries keyed as Hub leaderboards key them, .eval_results files read back by
huggingface_hub's own parser, the pull request as one commit through a mocked HfApi, and offline refusal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData, constants, metadata_load, parse_eval_result_entries
from huggingface_hub.errors import RemoteEntryNotFoundError
from huggingface_hub.repocard_data import model_index_to_eval_results

from hf_geosharp import __version__, cli
from hf_geosharp.hub import publish
from hf_geosharp.hub.cards import (
    BALL_NOTE,
    TEMPLATE_DIR,
    CardError,
    DatasetInfo,
    dataset_info,
    eval_result,
    known_task,
    merge,
    new_card,
    read_results,
)
from hf_geosharp.measures import MEASURES

EXISTING = """---
license: mit
base_model: google/vit-base-patch16-224
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
ENGINE = {"geodesic_sharpness_inv": "geodesic_inv_worst", "geodesic_sharpness_mix": "geodesic_mix_worst",
          "adaptive_sharpness": "adaptive_clean_worst", "relative_flatness": "relative_flatness",
          "hessian_top_eigenvalue": "hessian_top_eigenvalue", "hessian_trace": "hessian_trace"}


def _result(measure: str, value: float, rho: float = 0.1, stderr: float = 0.01, converged: bool = True,
            **config) -> dict:
    geodesic = measure.startswith("geodesic")
    base = {"rho": rho, "mode": "worst", "steps": 20, "seed": 0, "n_samples": 20, "params": "all", "n_batches": 2}
    base.update({"metric": measure.split("_")[1], "epsilon": 1e-6, "ball": "calibrated"} if geodesic
                else {"variant": "clean"})
    if measure == "relative_flatness":  # no rho and no solver: a layer and Hutchinson samples
        base = {"layer": "classifier", "n_samples": 20, "seed": 0, "n_batches": 2}
    if measure.startswith("hessian"):  # no rho: power iterations, or Hutchinson samples
        base = ({"estimator": "hutchinson", "n_samples": 20, "mode": "average"} if measure == "hessian_trace" else
                {"estimator": "power_iteration", "max_iters": 100, "tol": 1e-3})
        base.update({"seed": 0, "params": "all", "n_batches": 2})
    return {"measure": measure, "value": value, "per_batch": [value, value], "clean_loss": 0.3, "stderr": stderr,
            "per_batch_clean_loss": [0.3, 0.3], "config": {**base, **config}, "converged": converged}


def _all_results() -> list[dict]:
    return [_result(ENGINE[key], 0.1 * (i + 1)) for i, key in enumerate(MEASURES)]


def _run_json(path: Path, *results: dict, dataset: str = "glue", config: str | None = "sst2",
              model_class: str = "ViTForImageClassification") -> Path:
    """What `geosharp run --json` writes."""
    payload = {"hf_geosharp_version": __version__, "model": "my-vit", "model_class": model_class,
               "data": {"dataset": dataset, "config": config, "split": "validation", "n_examples": 64,
                        "batch_size": 32, "seed": 0},
               "results": list(results)}
    path.write_text(json.dumps(payload))
    return path


def _leaderboard_key(e) -> tuple:
    return (e.task_type, e.dataset_type, e.dataset_config, e.dataset_split, e.metric_type)


def test_every_measure_gets_its_own_leaderboard_key_after_a_round_trip(tmp_path, capsys):
    readme = tmp_path / "my-vit" / "README.md"
    readme.parent.mkdir()
    readme.write_text(EXISTING)
    run = _run_json(tmp_path / "run.json", *_all_results())
    assert cli.main(["card", str(readme.parent), "--results", str(run)]) == 0
    assert "- name: my-vit" in capsys.readouterr().out  # the snippet names the model as the card does

    name, parsed = model_index_to_eval_results(metadata_load(readme)["model-index"])
    ours = [e for e in parsed if e.metric_type != "accuracy"]
    assert name == "my-vit" and len(ours) == len(MEASURES)
    assert {_leaderboard_key(e) for e in ours} == {("image-classification", "glue", "sst2", "validation", key)
                                                    for key in MEASURES}  # one distinct key per measure
    inv = next(e for e in ours if e.metric_type == "geodesic_sharpness_inv")
    assert inv.metric_config == "geodesic_inv_worst" and inv.metric_value == 0.1
    assert inv.metric_args == {"rho": 0.1, "mode": "worst", "steps": 20, "seed": 0, "n_batches": 2,
                               "epsilon": 1e-6, "ball": "calibrated", "params": "all", "stderr": 0.01,
                               "certified": True}
    assert inv.dataset_args == {"n_examples": 64, "batch_size": 32, "seed": 0}
    assert inv.source_url is None and inv.source_name is None  # the package has no homepage: no invented source

    card = ModelCard.load(readme)  # all else kept
    assert "**Do not lose this sentence.**" in card.text and "Trained for 10 epochs." in card.text
    assert card.data.license == "mit" and card.data.base_model == "google/vit-base-patch16-224"
    ModelCardData(**metadata_load(readme))  # raises on malformed card data
    assert "nan" not in readme.read_text().lower()

    # the same configuration again (another value and stderr): replaced, not duplicated; another rho is added
    rerun = _run_json(tmp_path / "rerun.json", _result("geodesic_inv_worst", 0.5, stderr=0.2),
                      _result("geodesic_inv_worst", 0.9, rho=0.5))
    assert cli.main(["card", str(readme), "--results", str(rerun)]) == 0
    invs = [e for e in ModelCard.load(readme).data.eval_results if e.metric_type == "geodesic_sharpness_inv"]
    assert sorted((e.metric_args["rho"], e.metric_value) for e in invs) == [(0.1, 0.5), (0.5, 0.9)]


def test_an_uncertified_value_is_published_as_a_lower_bound_in_both_formats(tmp_path, capsys):
    """A real run at steps=1 is not certified: the model-index keeps ``certified: false`` in the metric's args (read
    back by huggingface_hub's parser) and says "lower bound" in its name, the .eval_results notes say it, the command
    names it on stderr; a certified value says so; relative flatness has no certificate. A certified rerun of the same
    configuration replaces the lower bound."""
    import torch

    import hf_geosharp as gs

    from .fixtures.hf_models import tiny_bert

    torch.manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (4, 8)), "labels": torch.tensor([0, 1, 0, 1])}]
    with pytest.warns(gs.NotConvergedWarning):
        # the paper's mix ball at rho 0.1 is large on this model: one step is far from stationary
        lower = gs.geodesic_sharpness(tiny_bert(), batches, metric="mix", ball="paper", steps=1,
                                      progress=False).to_dict()
    assert lower["converged"] is False  # the engine's own verdict: one step is not stationary
    run = _run_json(tmp_path / "run.json", lower, _result("geodesic_inv_worst", 0.2),
                    _result("relative_flatness", 3.0))
    model = tmp_path / "m"
    args = ["card", str(model), "--results", str(run), "--format", "both", "--benchmark", "me/bench"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"geodesic_sharpness_mix ≥ {lower['value']:.4g} (not certified)" in err and "1 of 3" in err

    _, parsed = model_index_to_eval_results(metadata_load(model / "README.md")["model-index"])
    by_key = {e.metric_type: e for e in parsed}
    mix, inv, flat = by_key["geodesic_sharpness_mix"], by_key["geodesic_sharpness_inv"], by_key["relative_flatness"]
    assert mix.metric_args["certified"] is False and "not certified (a lower bound of the maximum)" in mix.metric_name
    assert mix.metric_value == pytest.approx(lower["value"])
    assert inv.metric_args["certified"] is True and "certified" not in inv.metric_name
    assert "certified" not in flat.metric_args  # an exact trace: no certificate, and none claimed

    notes = {e.task_id: e.notes for e in parse_eval_result_entries(
        yaml.safe_load((model / ".eval_results" / "me__bench.yaml").read_text()))}
    assert notes["geodesic_sharpness_mix"].endswith("; not certified (a lower bound of the maximum)")
    assert notes["geodesic_sharpness_inv"].endswith("; certified")
    assert notes["relative_flatness"].endswith("; no certificate (not a worst case)")

    certified_rerun = {**lower, "value": lower["value"] * 2, "converged": True}
    assert cli.main(["card", str(model), "--results", str(_run_json(tmp_path / "again.json", certified_rerun))]) == 0
    assert "not certified" not in capsys.readouterr().err
    mixes = [e for e in ModelCard.load(model / "README.md").data.eval_results
             if e.metric_type == "geodesic_sharpness_mix"]
    assert [(e.metric_value, e.metric_args["certified"]) for e in mixes] == [(certified_rerun["value"], True)]


def test_local_data_is_not_written_as_a_hub_dataset_and_source_is_what_the_user_passed(tmp_path):
    data = tmp_path / "reviews.csv"
    data.write_text("text,label\nok,1\n")
    run = _run_json(tmp_path / "run.json", _result("geodesic_mix_worst", 0.2), dataset=str(data), config=None,
                    model_class="BertForSequenceClassification")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert", "transformers_version": "5.0"}))
    url = "https://huggingface.co/spaces/me/geosharp"
    assert cli.main(["card", str(tmp_path / "m"), "--results", str(run), "--source-url", url]) == 0
    card = ModelCard.load(tmp_path / "m" / "README.md")
    (entry,) = card.data.eval_results
    assert entry.dataset_name == "reviews.csv" and entry.dataset_type == "local:reviews.csv"  # ':' is never a Hub id
    assert entry.dataset_config is None and entry.dataset_revision is None
    assert entry.task_type == "text-classification" and entry.source_url == url
    assert card.data.library_name == "transformers" and card.data.get("base_model") is None  # known, not invented
    assert card.data.get("license") is None


def test_hub_data_keeps_config_split_and_revision():
    info = dataset_info({"data": {"dataset": "glue:sst2", "split": "validation"}}, revision="abc123")
    assert (info.type, info.name, info.config, info.split, info.revision, info.local) == (
        "glue", "glue", "sst2", "validation", "abc123", False)
    assert dataset_info({"data": {"dataset": "/no/such/folder"}}).local
    assert dataset_info({}, name="digits", local=True).type == "local:digits"


def test_task_types_from_head_classes():
    assert known_task("GPT2LMHeadModel") == known_task("LlamaForCausalLM") == "text-generation"
    assert known_task("BertForTokenClassification") == "token-classification"
    assert known_task("WhisperForConditionalGeneration") == "text2text-generation"
    assert known_task("CLIPForZeroShotImageClassification") == "zero-shot-image-classification"
    assert known_task("MyOwnModel") is None


def test_unknown_task_says_so(tmp_path, capsys):
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.2), model_class="MyOwnModel")
    assert cli.main(["card", str(tmp_path / "m"), "--results", str(run)]) == 0
    assert "--task-type" in capsys.readouterr().err
    assert ModelCard.load(tmp_path / "m" / "README.md").data.eval_results[0].task_type == "other"


def test_nan_is_never_written(tmp_path, capsys):
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.2),
                    _result("adaptive_clean_worst", math.nan))
    assert cli.main(["card", str(tmp_path / "m"), "--results", str(run)]) == 2
    assert "adaptive_sharpness" in capsys.readouterr().err and not (tmp_path / "m").exists()
    single = eval_result(_result("geodesic_inv_worst", 0.2, stderr=math.nan), DatasetInfo("glue", "train"),
                         "text-classification")
    assert "stderr" not in single.metric_args  # a single worst-case batch has no error bar: none is written


@pytest.mark.skipif("relative_flatness" not in MEASURES, reason="relative flatness is not in this bundle")
def test_relative_flatness_records_its_own_settings():
    entry = eval_result(_result("relative_flatness", 3.0), DatasetInfo("glue", "train"), "text-classification")
    assert entry.metric_type == "relative_flatness" and entry.metric_name.startswith("Relative flatness")
    assert entry.metric_args == {"n_samples": 20, "seed": 0, "n_batches": 2, "layer": "classifier", "stderr": 0.01}


def test_average_case_records_samples_not_steps():
    average = eval_result(_result("geodesic_inv_average", 1.0, mode="average"), DatasetInfo("glue", "train"),
                          "text-classification")
    assert average.metric_args["n_samples"] == 20 and "steps" not in average.metric_args
    ablated = eval_result(_result("geodesic_mix_worst", 1.0, second_order=False), DatasetInfo("glue", "train"),
                          "text-classification")
    assert ablated.metric_args["second_order"] is False


def test_eval_results_files_are_read_back_by_huggingface_hub(tmp_path, capsys):
    run = _run_json(tmp_path / "run.json", *_all_results())
    model = tmp_path / "m"
    assert cli.main(["card", str(model), "--results", str(run), "--format", "eval-results"]) == 2
    assert "--benchmark" in capsys.readouterr().err and not model.exists()  # refused before writing

    args = ["card", str(model), "--results", str(run), "--format", "both", "--benchmark", "me/geosharp-bench",
            "--source-url", "https://huggingface.co/spaces/me/geosharp"]
    assert cli.main(args) == 0
    files = sorted((model / ".eval_results").iterdir())
    assert [f.name for f in files] == ["me__geosharp-bench.yaml"]
    entries = parse_eval_result_entries(yaml.safe_load(files[0].read_text()))
    assert {e.task_id for e in entries} == set(MEASURES) and {e.dataset_id for e in entries} == {"me/geosharp-bench"}
    inv = next(e for e in entries if e.task_id == "geodesic_sharpness_inv")
    assert inv.value == 0.1 and "stderr=0.01" in inv.notes and "rho=0.1" in inv.notes and "glue" in inv.notes
    assert inv.source_url.endswith("me/geosharp") and inv.source_name == f"hf_geosharp {__version__}"
    assert ModelCard.load(model / "README.md").data.eval_results  # both: the model-index too

    # a rerun replaces the benchmark's entries (a benchmark fixes the settings); nothing is duplicated
    assert cli.main(args[:3] + [str(_run_json(tmp_path / "r2.json", _result("geodesic_inv_worst", 0.7)))]
                    + args[4:]) == 0
    again = parse_eval_result_entries(yaml.safe_load(files[0].read_text()))
    assert len(again) == len(MEASURES) and next(e for e in again if e.task_id == "geodesic_sharpness_inv").value == 0.7


def test_eval_yaml_template_lists_every_measure():
    template = yaml.safe_load((TEMPLATE_DIR / "eval.yaml").read_text())
    ids = {t["id"] for t in template["tasks"]}
    assert set(MEASURES) <= ids and all({"id", "config", "split"} <= set(t) for t in template["tasks"])
    assert template["name"] and template["description"]


def test_bad_results_and_missing_dataset_are_refused(tmp_path, capsys):
    results = tmp_path / "api.json"  # SharpnessResult.to_dict() output: no dataset recorded
    results.write_text(json.dumps([_result("geodesic_inv_worst", 0.1)]))
    assert cli.main(["card", str(tmp_path / "model"), "--results", str(results)]) == 2
    assert "--dataset" in capsys.readouterr().err and not (tmp_path / "model").exists()
    (tmp_path / "empty.json").write_text(json.dumps({"results": {}}))
    with pytest.raises(CardError, match="no sharpness results"):
        read_results(tmp_path / "empty.json")


def test_push_offline_fails_clearly_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(publish, "HfApi", lambda *a, **k: pytest.fail("HfApi used while offline"))
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.25))
    args = ["card", str(tmp_path / "model"), "--results", str(run), "--format", "both", "--benchmark", "me/b",
            "--push", "me/my-vit"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "offline" in err and "HF_HUB_OFFLINE" in err and "me/my-vit" in err
    assert not (tmp_path / "model").exists()


def test_dry_run_prints_the_files_and_the_pull_request_and_writes_and_sends_nothing(tmp_path, monkeypatch, capsys):
    """Offline too: the dry run reads no remote file and needs no network; the title and body it prints are the ones
    a push sends (one function makes both)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(publish, "HfApi", lambda *a, **k: pytest.fail("HfApi used by a dry run"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "README.md").write_text(EXISTING)
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.25))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args = ["card", str(model), "--results", str(run), "--format", "both", "--benchmark", "me/b",
            "--push", "me/my-vit", "--results-repo", "me/results", "--dry-run"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    title, body = publish.pull_request_text(["README.md", ".eval_results/me__b.yaml"])
    assert f"title: {title}" in out and f"body: {body}" in out and "would open a pull request on me/my-vit" in out
    assert f"into {model / 'README.md'}" in out and str(model / ".eval_results" / "me__b.yaml") in out
    assert "geodesic_sharpness_inv" in out and "would commit" in out and "me/results" in out
    assert out.rstrip().endswith("nothing was written or sent")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


class FakeApi:
    """The part of HfApi that publishing uses: downloads of the repo's files and commits (recorded)."""

    def __init__(self, files: dict[str, str], tmp: Path) -> None:
        self.files, self.tmp, self.commits = files, tmp, []

    def hf_hub_download(self, repo_id, filename, repo_type="model"):
        if filename not in self.files:
            raise RemoteEntryNotFoundError(f"{filename} not found", response=_Response())
        path = self.tmp / filename.replace("/", "_")
        path.write_text(self.files[filename])
        return str(path)

    def create_commit(self, repo_id, operations, **kwargs):
        self.commits.append(dict(repo_id=repo_id, files={op.path_in_repo: op.path_or_fileobj for op in operations},
                                 **kwargs))
        return type("Info", (), {"pr_url": f"https://huggingface.co/{repo_id}/discussions/1",
                                 "commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()


class _Response:
    status_code, headers, url, request = 404, {}, "https://huggingface.co", None


def test_push_is_one_pull_request_commit_with_the_merged_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    old_entries = yaml.safe_dump([{"dataset": {"id": "me/b", "task_id": "other_task"}, "value": 3.0}])
    api = FakeApi({"README.md": EXISTING, ".eval_results/me__b.yaml": old_entries}, tmp_path)
    monkeypatch.setattr(publish, "HfApi", lambda token=None: (api.__setattr__("token", token), api)[1])
    run = _run_json(tmp_path / "run.json", *_all_results())
    args = ["card", str(tmp_path / "local"), "--results", str(run), "--format", "both", "--benchmark", "me/b",
            "--push", "me/my-vit", "--token", "hf_secret", "--results-repo", "me/results"]
    assert cli.main(args) == 0
    assert "discussions/1" in capsys.readouterr().out and api.token == "hf_secret"
    pr, details = api.commits
    assert pr["repo_id"] == "me/my-vit" and pr["create_pr"] is True
    assert set(pr["files"]) == {"README.md", ".eval_results/me__b.yaml"}  # card and eval results in one commit
    card = ModelCard(pr["files"]["README.md"].decode())
    assert "Do not lose this sentence." in card.text and card.data.license == "mit"
    assert [r.metric_type for r in card.data.eval_results] == ["accuracy", *MEASURES]
    pushed = parse_eval_result_entries(yaml.safe_load(pr["files"][".eval_results/me__b.yaml"]))
    assert [e.task_id for e in pushed] == ["other_task", *MEASURES]  # the repo's other entries kept
    # the run JSON, laid out like the Open LLM Leaderboard's details: <org>/<model>/results_<timestamp>.json
    assert details["repo_id"] == "me/results" and details["repo_type"] == "dataset"
    (path,) = details["files"]
    assert path.startswith("me/my-vit/results_") and path.endswith(".json")
    assert json.loads(details["files"][path]) == json.loads(run.read_text())


def test_push_to_a_repo_without_a_card_creates_one(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = FakeApi({}, tmp_path)
    entry = eval_result(_result("geodesic_inv_worst", 0.25), DatasetInfo("glue", "train"), "text-classification")
    urls = publish.push(publish.Publication("me/new", [entry]), api=api)
    (commit,) = api.commits
    assert urls["pull_request"].endswith("/discussions/1") and set(commit["files"]) == {"README.md"}
    card = ModelCard(commit["files"]["README.md"].decode())
    assert [r.metric_type for r in card.data.eval_results] == ["geodesic_sharpness_inv"]


def test_push_refuses_a_remote_card_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    api = FakeApi({"README.md": "---\nlicense: [unclosed\n---\n\ntext\n"}, tmp_path)
    entry = eval_result(_result("geodesic_inv_worst", 0.25), DatasetInfo("glue", "train"), "text-classification")
    with pytest.raises(CardError, match="cannot be read"):
        publish.push(publish.Publication("me/broken", [entry]), api=api)
    assert api.commits == []


def test_a_local_card_that_cannot_be_read_stops_everything(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    broken = "---\nlicense: [unclosed\n---\n\nmy text\n"
    (tmp_path / "m" / "README.md").write_text(broken)
    run = _run_json(tmp_path / "run.json", _result("geodesic_inv_worst", 0.25))
    args = ["card", str(tmp_path / "m"), "--results", str(run), "--format", "both", "--benchmark", "me/b"]
    assert cli.main(args) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert (tmp_path / "m" / "README.md").read_text() == broken and not (tmp_path / "m" / ".eval_results").exists()


def test_the_ball_is_published_and_a_record_without_one_is_the_papers():
    """Two geodesic numbers are comparable only under the same radius convention: the card's args and display name
    say it; a record made before the convention existed (no ``ball``) was the paper's; adaptive has none."""
    info = DatasetInfo("glue", "train")
    calibrated = eval_result(_result("geodesic_mix_worst", 1.0), info, "text-classification")
    record = _result("geodesic_mix_worst", 2.0)
    del record["config"]["ball"]
    old = eval_result(record, info, "text-classification")
    adaptive = eval_result(_result("adaptive_clean_worst", 1.0), info, "text-classification")
    assert calibrated.metric_args["ball"] == "calibrated" and "calibrated ball" in calibrated.metric_name
    assert old.metric_args["ball"] == "paper" and "paper ball" in old.metric_name
    assert "ball" not in adaptive.metric_args and "ball" not in adaptive.metric_name
    card = merge(new_card("m"), [calibrated, old], "m")
    assert len(card.data.eval_results) == 2  # not one measurement replacing the other
    assert BALL_NOTE in card.text and "`ball`" in BALL_NOTE


# ------------------------------------------------------------------------------------------- whose numbers
def _model_folder(path: Path, weights: bytes = b"the weights") -> Path:
    path.mkdir()
    (path / "model.safetensors").write_bytes(weights)
    (path / "README.md").write_text(EXISTING)
    return path


def _measured_run(path: Path, weights: bytes, head: dict | None = None, used: int = 32) -> Path:
    """A `geosharp run --json` file that records the weights' sha256, the examples used and the head."""
    import hashlib

    run = _run_json(path, _result("geodesic_inv_worst", 0.2), _result("adaptive_clean_worst", 0.4))
    payload = json.loads(run.read_text())
    payload["data"].update(n_examples=1024, n_examples_used=used)
    payload["config"] = {"head": head}
    payload["model_source"] = {"source": "elsewhere", "weights_sha256": {
        "model.safetensors": hashlib.sha256(weights).hexdigest()}}
    run.write_text(json.dumps(payload))
    return run


def test_results_of_other_weights_are_refused_before_anything_is_written(tmp_path, capsys):
    model = _model_folder(tmp_path / "m")
    foreign = _measured_run(tmp_path / "run.json", b"another model's weights")
    before = sorted((p.name, p.read_bytes()) for p in model.rglob("*"))
    for extra in ([], ["--dry-run"], ["--format", "both", "--benchmark", "me/b"]):
        assert cli.main(["card", str(model), "--results", str(foreign), *extra]) == 2
        err = capsys.readouterr().err
        assert "measured on other weights" in err and "--force" in err and "Nothing was written" in err
    assert sorted((p.name, p.read_bytes()) for p in model.rglob("*")) == before

    args = ["card", str(model), "--results", str(foreign), "--force", "--format", "both", "--benchmark", "me/b"]
    assert cli.main(args) == 0
    assert "--force" in capsys.readouterr().err
    text = ModelCard.load(model / "README.md").text
    assert "**Do not lose this sentence.**" in text
    assert text.count("weights other than this model's") == 2  # one line per entry
    entries = parse_eval_result_entries(yaml.safe_load((model / ".eval_results" / "me__b.yaml").read_text()))
    assert all("weights other than this model's" in e.notes for e in entries)


def test_results_of_these_weights_pass_and_results_without_a_digest_are_published_with_a_warning(tmp_path, capsys):
    model = _model_folder(tmp_path / "m")
    assert cli.main(["card", str(model), "--results", str(_measured_run(tmp_path / "run.json", b"the weights"))]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "hf_geosharp notes" not in (model / "README.md").read_text()
    assert cli.main(["card", str(model), "--results", str(_run_json(tmp_path / "old.json", _result(
        "geodesic_inv_worst", 0.1)))]) == 0
    assert "record no weights sha256" in capsys.readouterr().err


def test_the_card_states_the_examples_measured_and_a_fresh_head(tmp_path, capsys):
    model = _model_folder(tmp_path / "m")
    headed = _measured_run(tmp_path / "run.json", b"the weights", head={"num_labels": 2, "seed": 7}, used=32)
    assert cli.main(["card", str(model), "--results", str(headed), "--format", "both", "--benchmark", "me/b"]) == 0
    _, parsed = model_index_to_eval_results(metadata_load(model / "README.md")["model-index"])
    ours = [e for e in parsed if e.metric_type != "accuracy"]
    assert len(ours) == 2 and all(e.dataset_args["n_examples"] == 32 for e in ours)  # not the 1024 asked for
    assert all(e.metric_args["head"] == "new, 2 classes, seed 7" for e in ours)
    text = ModelCard.load(model / "README.md").text
    assert text.count("freshly initialised 2-class head (seed 7") == 2
    entries = parse_eval_result_entries(yaml.safe_load((model / ".eval_results" / "me__b.yaml").read_text()))
    assert all("freshly initialised 2-class head" in e.notes and "32 examples" in e.notes for e in entries)

    # the same measurements with the model's own head: new entries (another configuration), and the head's notes
    # stay with the entries they describe; a rerun of the headed run replaces its lines instead of adding more
    own = _measured_run(tmp_path / "own.json", b"the weights")
    assert cli.main(["card", str(model), "--results", str(own)]) == 0
    assert ModelCard.load(model / "README.md").text.count("freshly initialised 2-class head") == 2
    assert cli.main(["card", str(model), "--results", str(headed)]) == 0
    card = ModelCard.load(model / "README.md")
    assert len([e for e in card.data.eval_results if e.metric_type != "accuracy"]) == 4
    assert card.text.count("freshly initialised 2-class head") == 2 and card.text.count("hf_geosharp notes:") == 1
