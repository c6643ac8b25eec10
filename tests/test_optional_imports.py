"""Optional pieces are imported only where they are used: ``import hf_geosharp``, ``geosharp --help`` and an unsharded
run need neither FSDP nor the Hub's ``.eval_results`` classes; a huggingface_hub without those classes, or a missing
gradio, gets an error that names the release or the extra needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from hf_geosharp.hub import cards

REPO = Path(__file__).resolve().parents[1]
EVAL_RESULT_NAMES = ("EvalResultEntry", "eval_result_entries_to_yaml", "parse_eval_result_entries")


def test_import_help_and_a_run_work_without_fsdp_or_the_eval_results_classes():
    """A fresh process whose huggingface_hub lacks the ``.eval_results`` classes (as before 1.4) imports the package,
    prints the CLI help and measures a plain torch model; FSDP is never imported (a transformers model would import
    it: transformers imports its own FSDP support when it builds one)."""
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        import huggingface_hub
        hub_getattr = huggingface_hub.__getattr__
        def old_hub(name):
            if name in {EVAL_RESULT_NAMES!r}:
                raise AttributeError(name)
            return hub_getattr(name)
        huggingface_hub.__getattr__ = old_hub
        for name in {EVAL_RESULT_NAMES!r}:
            huggingface_hub.__dict__.pop(name, None)

        import hf_geosharp as gs
        from hf_geosharp import cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                cli.main(["--help"])
            except SystemExit as exit:
                code = exit.code
        import torch
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        batch = (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        value = gs.geodesic_sharpness(model, [batch], loss_fn=loss, steps=2, progress=False).value
        print(json.dumps({{"code": code, "help": out.getvalue(), "value": value,
                          "fsdp": sorted(m for m in sys.modules if m.startswith("torch.distributed.fsdp"))}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["code"] in (0, None) and "usage: geosharp" in got["help"]
    assert got["value"] > 0
    assert got["fsdp"] == [], "an unsharded run imported FSDP"


def test_the_eval_results_format_names_the_hub_release_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(__version__="1.3.0"))
    for use in (lambda: cards.entries_yaml([]), lambda: cards.read_entries("[]")):
        with pytest.raises(cards.CardError, match=r"need huggingface_hub>=1\.4\.0 \(installed: 1\.3\.0\)"):
            use()


def test_exporting_the_space_without_gradio_names_the_extra(monkeypatch):
    from hf_geosharp.commands import export_space

    monkeypatch.setitem(sys.modules, "gradio", None)  # what a missing package looks like to ``import gradio``
    with pytest.raises(export_space.ExportError, match=r"pip install 'hf_geosharp\[space\]'"):
        export_space.space_readme(REPO)


def test_the_space_app_without_gradio_names_the_extra(monkeypatch):
    """``python spaces_demo/app.py`` after the core install: the error names the extra and its install command."""
    import importlib.util

    monkeypatch.setitem(sys.modules, "gradio", None)
    spec = importlib.util.spec_from_file_location("space_app_without_gradio", REPO / "spaces_demo" / "app.py")
    with pytest.raises(ModuleNotFoundError, match=r"the Space needs the `space` extra \(gradio is not installed\): "
                                                  r"pip install \"hf_geosharp\[space\]\""):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
