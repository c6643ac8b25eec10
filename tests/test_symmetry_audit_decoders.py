"""The block audit on tiny decoders saved from their configs, and a verdict that tells a real gap from rounding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

from hf_geosharp import cli
from hf_geosharp.symmetry import PairBlock, map_symmetries
from hf_geosharp.symmetry.audit_blocks import block_audit
from hf_geosharp.symmetry.audit_rank import DOUBT, judge, rank_tolerance

_DEC = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=16,
            max_position_embeddings=128)
CONFIGS = {  # as a user saves them: default init (std 0.02), float32 on disk
    "llama_gqa": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_DEC, num_key_value_heads=2)),
    "qwen2_bias": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_DEC, num_key_value_heads=2)),
    "mistral_sliding": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_DEC, num_key_value_heads=2,
                                                                        sliding_window=8)),
    "gpt2_conv1d": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=4,
                                                            n_positions=128)),
    "gpt_neox_partial": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**_DEC, rotary_pct=0.5)),
    "phi_partial": lambda: tf.PhiForCausalLM(tf.PhiConfig(**_DEC)),
    "bert": lambda: tf.BertModel(tf.BertConfig(**{**_DEC, "num_attention_heads": 2})),
    "vit": lambda: tf.ViTModel(tf.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=16)),
}


def _saved(name: str, folder) -> str:
    torch.manual_seed(0)
    CONFIGS[name]().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cli_block_audit_passes_on_a_tiny_model_saved_from_its_config(name, tmp_path, capsys):
    path = _saved(name, tmp_path / name)
    out_json = tmp_path / "audit.json"
    code = cli.main(["symmetry", path, "--audit", "--layers", "0", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (block,) = json.loads(out_json.read_text())["audit_blocks"]
    assert block["verdict"] == "PASS" and "verdict: PASS" in printed
    assert block["rank"] == block["predicted_rank"] and block["gap"] == block["gap_within_rounding"] == 0
    hi, lo = block["singular_values_at_cut"]
    assert lo < block["tolerance"] / DOUBT < block["tolerance"] * DOUBT < hi  # a clean cut, clear of rounding


def _vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return CONFIGS["vit"]().double().eval()


def test_vit_eager_softmax_in_float32_is_refused_before_any_work_and_sdpa_passes():
    model = _vit()
    model.set_attn_implementation("eager")  # ViT's eager attention runs its softmax in float32
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"softmax in float32.*sdpa"):
        block_audit(model, [0], log=lambda _: pytest.fail("the audit started"))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.config._attn_implementation == "eager"

    fixed = copy.deepcopy(model)
    fixed.set_attn_implementation("sdpa")
    (result,) = block_audit(fixed, [0], log=lambda _: None)
    assert result.verdict == "PASS" and result.rank == result.predicted_rank
    assert result.singular_values_at_cut[1] < 1e-14 < 1e-10 < result.singular_values_at_cut[0]


def test_a_map_claiming_too_much_symmetry_still_fails_on_a_decoder():
    torch.manual_seed(0)
    model = CONFIGS["llama_gqa"]().double().eval()
    model.set_attn_implementation("sdpa")
    smap = map_symmetries(model)
    qk = next(b for b in smap.blocks if b.kind == "qk")
    smap.blocks.append(PairBlock("qk", qk.module, qk.G_index, qk.H_index, qk.lie_basis))  # the QK orbits twice
    (wrong,) = block_audit(model, [0], smap, log=lambda _: None)
    assert wrong.verdict == "FAIL" and wrong.gap == -qk.n_pairs * qk.group_dim
    assert wrong.gap_within_rounding == 0


def _spectrum(real: int, tail: list[float], n: int = 100) -> torch.Tensor:
    """``real`` singular values in [1, 0.1], then ``tail`` (relative values), then round-off at 1e-17."""
    values = torch.cat([torch.linspace(1.0, 0.1, real, dtype=torch.float64), torch.tensor(tail, dtype=torch.float64),
                        torch.full((n - real - len(tail),), 1e-17, dtype=torch.float64)])
    return values


def test_verdict_counts_only_singular_values_clear_of_rounding():
    shape = (116, 100)
    tol = rank_tolerance(_spectrum(60, []), shape)
    # values within two decades of the tolerance on both sides of the predicted cut: not told from rounding
    near = _spectrum(60, [tol * 10, tol * 3, tol / 3])
    judged = judge(near, 60, rank_tolerance(near, shape))
    assert (judged.verdict, judged.gap, judged.rank, judged.gap_within_rounding) == ("PASS", 0, 62, -2)
    # real directions the map calls null: the map claims too much symmetry
    wrong = _spectrum(60, [1e-6, 1e-7])
    judged = judge(wrong, 60, rank_tolerance(wrong, shape))
    assert (judged.verdict, judged.gap) == ("FAIL", -2)
    # directions the prediction calls real are at round-off: a redundancy it does not name
    missing = judge(_spectrum(60, []), 63, tol)
    assert (missing.verdict, missing.gap, missing.gap_within_rounding) == ("FAIL", 3, 0)
    assert judge(_spectrum(60, []), 60, tol).verdict == "PASS"
