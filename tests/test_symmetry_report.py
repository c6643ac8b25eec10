"""The symmetry report (conditioning, warnings, table, JSON) and the ``geosharp symmetry`` command."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from hf_geosharp import cli
from hf_geosharp.symmetry import map_symmetries
from hf_geosharp.symmetry.report import format_report

from .fixtures.architectures import build


def test_conditioning_matches_the_weights_and_flags_near_singular_heads():
    model = build("bert").model
    attention = model.bert.encoder.layer[0].attention.self
    d = attention.attention_head_size
    with torch.no_grad():
        attention.query.weight[d + 2].mul_(1e-6)  # head 1: one column of G almost vanishes
        attention.query.bias[d + 2].mul_(1e-6)
    smap = map_symmetries(model)
    report = smap.summary(model)
    json.dumps(report)  # JSON-ready

    rows = [p for p in report["conditioning"]["pairs"] if p["kind"] == "qk"]
    g_head1 = torch.cat([attention.query.weight[d:2 * d], attention.query.bias[d:2 * d, None]], dim=1).T
    sv = torch.linalg.svdvals(g_head1)
    assert rows[1]["G_smin"] == pytest.approx(sv[-1].item(), rel=1e-10)
    assert rows[1]["G_smax"] == pytest.approx(sv[0].item(), rel=1e-10)

    warnings = report["conditioning"]["warnings"]
    assert len(warnings) == 1 and "head 1" in warnings[0] and "near-singular" in warnings[0]
    eps = report["conditioning"]["suggested_epsilon"]
    damped = (sv**2 + eps)
    assert sv[0] ** 2 / sv[-1] ** 2 > 1e9 and damped.max() / damped.min() < 2e6  # eps tames that head

    text = format_report(report)
    assert "near-singular" in text and "suggested epsilon" in text and "GL(8)" in text


def test_healthy_model_has_no_warnings_and_zero_lora_factor_is_flagged():
    healthy = build("llama_gqa").model
    report = map_symmetries(healthy).summary(healthy)
    assert report["conditioning"]["warnings"] == [] and report["conditioning"]["suggested_epsilon"] is None
    assert all(b["group"].startswith("subgroup") for b in report["blocks"] if b["kind"] == "qk")

    lora = build("lora").model
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.zero_()  # PEFT's default initialisation
    report = map_symmetries(lora).summary(lora)
    assert len(report["conditioning"]["warnings"]) == 2
    assert all("is zero" in w for w in report["conditioning"]["warnings"])


def _cli(*args: str) -> int:
    """``geosharp symmetry ARGS`` through the real console entry point."""
    return cli.main(["symmetry", *args])


def test_cli_help_lists_the_symmetry_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "symmetry" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["symmetry", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--audit" in text and "--strict" in text and "exit codes" in text


def _save(model: torch.nn.Module, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    config = tf.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=16, max_position_embeddings=16)
    path = _save(tf.BertModel(config), tmp_path / "bert")
    out_json = tmp_path / "report" / "symmetry.json"
    assert _cli(path, "--json", str(out_json)) == 0
    printed = capsys.readouterr().out
    assert "8 QK, 8 VO" in printed and "encoder.layer.1.attention" in printed
    report = json.loads(out_json.read_text())
    assert (report["n_pairs_qk"], report["n_pairs_vo"], report["head_dims"]) == (8, 8, [4])
    assert len(report["conditioning"]["pairs"]) == 16


def test_cli_offline_hub_id_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _cli("no-such-org/no-such-model") == 2
    err = capsys.readouterr().err
    assert "no-such-org/no-such-model" in err and "offline" in err.lower()


def test_cli_strict_fails_on_unmappable_attention(tmp_path, capsys):
    config = tf.DebertaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=16, max_position_embeddings=16, relative_attention=True,
                              pos_att_type=["p2c", "c2p"], talking_head=True)  # talking heads mix the heads
    path = _save(tf.DebertaModel(config), tmp_path / "deberta")
    assert _cli(path) == 0
    assert "fallbacks" in capsys.readouterr().out
    assert _cli(path, "--strict") == 1
    assert "encoder.layer.0.attention" in capsys.readouterr().err


def test_cli_audit_on_a_tiny_model(tmp_path, capsys):
    config = tf.BertConfig(vocab_size=12, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=4, max_position_embeddings=8, type_vocab_size=1)
    path = _save(tf.BertModel(config), tmp_path / "micro")
    out_json = tmp_path / "audit.json"
    assert _cli(path, "--audit", "--json", str(out_json)) == 0
    assert "Dimension audit" in capsys.readouterr().out
    audit = json.loads(out_json.read_text())["audit"]
    assert audit["gap"] >= 0  # the map never claims more symmetry than the Jacobian shows
    assert any(name.startswith("pooler") for name in audit["inactive_params"])  # the pooler is not in outputs[0]
    assert audit["rank"] <= audit["quotient_dim"]


def test_cli_audit_refuses_a_big_model(tmp_path, capsys):
    config = tf.BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=16)
    path = _save(tf.BertModel(config), tmp_path / "big")
    assert _cli(path, "--audit") == 2
    assert "tiny models" in capsys.readouterr().err


def test_cli_block_audit_passes_on_a_tiny_bert_and_writes_json(tmp_path, capsys):
    config = tf.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=16, max_position_embeddings=16)
    path = _save(tf.BertModel(config), tmp_path / "bert")
    out_json = tmp_path / "audit.json"
    assert _cli(path, "--audit", "--layers", "1", "--json", str(out_json)) == 0
    printed = capsys.readouterr().out
    assert "estimated" in printed and "verdict: PASS" in printed and "encoder.layer.1.attention" in printed
    (block,) = json.loads(out_json.read_text())["audit_blocks"]
    assert block["verdict"] == "PASS" and block["rank"] == block["predicted_rank"]
    assert block["module"] == "encoder.layer.1.attention" and block["scope"] == "whole block"


def test_cli_layers_needs_audit_and_valid_indices(tmp_path, capsys):
    config = tf.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=16)
    path = _save(tf.BertModel(config), tmp_path / "bert")
    assert _cli(path, "--layers", "0") == 2
    assert "--audit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        _cli(path, "--audit", "--layers", "zero")
    assert exc.value.code == 2
    assert _cli(path, "--audit", "--layers", "7") == 2
    assert "mapped layers: [0]" in capsys.readouterr().err


def test_symmetry_modules_import_without_cycles():
    """Module-level relative imports of hf_geosharp.symmetry form a DAG (TYPE_CHECKING imports excluded)."""
    import ast
    from pathlib import Path

    import hf_geosharp.symmetry as pkg

    graph = {}
    for f in Path(pkg.__file__).parent.glob("*.py"):
        body = ast.parse(f.read_text()).body
        graph[f.stem] = {n.module for n in body if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}
    state: dict[str, int] = {}

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert state.get(node) != 1, f"import cycle: {' -> '.join(path + (node,))}"
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in graph.get(node, ()):
            visit(dep, path + (node,))
        state[node] = 2

    for node in graph:
        visit(node, ())
