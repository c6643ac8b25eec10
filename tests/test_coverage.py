"""A sample of the coverage sweep (experiments/coverage.py): tiny instances from default configs, mapped and probed."""

from __future__ import annotations

import pytest

from experiments import coverage, tiny_models


@pytest.mark.parametrize("model_type,layout", [("bert", "separate q/k/v"),
                                               ("gpt_bigcode", "GPTBigCode multi-query [Q | K | V]"),
                                               ("deberta-v2", "DeBERTa-v2 disentangled"),
                                               ("deepseek_v3", "multi-head latent attention"),
                                               ("mpt", "fused blocks Wqkv [Q | K | V]"),
                                               ("codegen", "CodeGen sharded qkv [mp, q | v | k]")])
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


def test_max_pooled_queries_fall_back_with_their_reason():
    row = coverage.examine("hiera")  # mask-unit attention max-pools q over the query stride
    assert row["status"] == "fallback" and all("max-pools" in f["reason"] for f in row["fallbacks"])


# each of these failed to build from its shrunk default config before the generator repaired it: per-layer lists
# (validate_layer_type), a field the validator names with its value, per-stage head lists, a None size, layer kinds
# that must all stay, a Mamba override, a sub-module with its own config
@pytest.mark.parametrize("model_type", ["deepseek_v32", "xlnet", "donut-swin", "ministral", "olmo_hybrid", "mamba2",
                                        "sam2_mask_decoder"])
def test_the_generator_satisfies_each_config_classs_validators(model_type):
    model = tiny_models.tiny_model(model_type)
    assert 0 < sum(p.numel() for p in model.parameters()) < 5_000_000


def test_repair_reads_what_the_refusal_asks():
    assert tiny_models.repair({"d_model": 32, "n_head": 4, "d_head": 32},
                              "`d_head` (32) should be equal to `d_model // n_head` (8)")["d_head"] == 8
    forced = tiny_models.repair({}, "hidden_size_per_layer_input must be 0, got 256")
    assert forced == {"hidden_size_per_layer_input": 0}
    nested = {"backbone_config": {"out_features": ["stage4"], "out_indices": [4]}}
    repaired = tiny_models.repair(nested, "out_features must be a subset of stage_names: ['stem', 'stage1']")
    assert repaired["backbone_config"] == {"out_features": None, "out_indices": None}
    assert nested["backbone_config"]["out_features"] == ["stage4"]  # a copy, the input is left alone
    assert tiny_models.repair({"a": 1}, "something unrelated") is None


def test_shrink_cuts_per_layer_entries_and_keeps_every_layer_kind():
    values = {"num_hidden_layers": 6, "layer_types": ["linear"] * 5 + ["full"],
              "mlp_layer_types": ["dense"] + ["sparse"] * 5, "per_layer_config": {"0": 1, "4": 2},
              "num_heads": [3, 6, 12, 24], "num_layers": 4, "depths": [2, 2, 6, 2]}
    out = tiny_models.shrink(values)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["linear", "linear"]
    assert out["per_layer_config"] == {"0": 1} and out["num_heads"] == [2, 4, 4, 4]
    assert out["depths"] == [2, 2, 6, 2]  # a backbone's stages are not layers
    kinds = tiny_models.shrink(values, kinds_first=True)
    assert kinds["layer_types"] == ["linear", "full"] and kinds["mlp_layer_types"] == ["dense", "sparse"]


def test_the_probe_fails_a_wrong_map():
    model = tiny_models.tiny_model("bert")
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
