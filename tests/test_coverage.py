"""A sample of the coverage sweep (experiments/coverage.py): tiny instances from default configs, mapped and probed."""

from __future__ import annotations

import pytest

from experiments import coverage


@pytest.mark.parametrize("model_type,layout", [("bert", "separate q/k/v"),
                                               ("gpt_bigcode", "GPTBigCode multi-query [Q | K | V]"),
                                               ("deberta-v2", "DeBERTa-v2 disentangled"),
                                               ("deepseek_v3", "multi-head latent attention")])
def test_mapped_types_pass_the_probe_and_the_control_is_visible(model_type, layout):
    row = coverage.examine(model_type)
    assert row["status"] == "mapped" and row["layouts"] == [layout]
    assert row["n_pairs_qk"] > 0 and row["n_pairs_vo"] > 0 and row["n_fallbacks"] == 0
    probe = row["probe"]
    assert probe["status"] == "passed"
    assert probe["max_rel_deviation"] <= coverage.PROBE_TOL < coverage.CONTROL_MIN <= probe["control_rel_deviation"]


def test_a_gated_attention_output_falls_back_with_its_reason():
    row = coverage.examine("bitnet")  # RMSNorm on the heads' output before o_proj: GL(h) on VO is broken
    assert row["status"] == "fallback" and "probe" not in row
    assert all("attn_sub_norm" in f["reason"] for f in row["fallbacks"])


def test_the_probe_fails_a_wrong_map():
    model = coverage.tiny_model("bert")
    from hf_geosharp.symmetry import map_symmetries

    smap = map_symmetries(model)
    qk, vo = (next(b for b in smap.blocks if b.kind == k) for k in ("qk", "vo"))
    qk.H_index, vo.G_index = vo.G_index.clone(), qk.H_index.clone()  # keys and values mixed up
    assert coverage.probe(model, smap)["status"] == "failed"


def test_sweep_runs_workers_and_counts():
    rows = coverage.sweep(["bert", "mamba", "timm_wrapper"], timeout=60)
    assert [r["model_type"] for r in rows] == ["bert", "mamba", "timm_wrapper"]
    assert [r["status"] for r in rows] == ["mapped", "no_attention", "not_built"]
    assert "timm" in rows[2]["reason"]
    head = coverage.headline(rows)
    assert (head["tried"], head["built"], head["fully_mapped_probe_verified"], head["not_built"]) == (3, 2, 1, 1)
    text = coverage.markdown({"headline": head, "rows": rows, "transformers": "x", "torch": "y", "seconds": 1.0})
    assert "| bert | mapped |" in text and "probe failed (wrong map)" in text
