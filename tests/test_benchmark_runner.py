"""``python -m benchmarks --only``: a run of some workloads keeps the rows of the others, marked as not rerun."""

from __future__ import annotations

from benchmarks.__main__ import keep_not_rerun, row_label


def _row(size: str, batch: int, seq: int, value: float) -> dict:
    return {"workload": {"size": size, "batch_size": batch, "seq_len": seq, "steps": 20, "n_batches": 1},
            "value": value}


def test_rows_not_rerun_keep_the_version_machine_and_date_they_were_measured_with():
    older = {"note": "old", "hf_geosharp": "0.5.1", "date": "d1", "machine": {"hf_geosharp": "0.5.1"},
             "rows": [_row("base", 8, 128, 1.0), _row("minilm", 8, 128, 2.0)]}
    previous = {"rows": [_row("minilm", 8, 128, 3.0), _row("minilm", 32, 128, 4.0)], "date": "d2",
                "machine": {"hf_geosharp": "0.7.0"}, "not_rerun": older}
    result = {"rows": [_row("minilm", 8, 128, 5.0)]}
    keep_not_rerun(previous, result, {"minilm-8x128"})
    first, second = result["not_rerun"]
    assert [r["value"] for r in first["rows"]] == [1.0] and first["hf_geosharp"] == "0.5.1"  # minilm-8x128 rerun
    assert [r["value"] for r in second["rows"]] == [4.0] and second["hf_geosharp"] == "0.7.0"
    assert second["date"] == "d2" and all("note" in b for b in (first, second))
    assert [row_label(r) for r in result["rows"]] == ["minilm-8x128"]


def test_a_run_of_every_workload_in_the_file_carries_nothing():
    previous = {"rows": [_row("minilm", 8, 128, 3.0)], "machine": {"hf_geosharp": "0.7.0"}, "date": "d"}
    result = {"rows": [_row("minilm", 8, 128, 5.0)]}
    keep_not_rerun(previous, result, {"minilm-8x128"})
    assert "not_rerun" not in result
