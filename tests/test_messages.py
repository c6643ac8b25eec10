"""What the library says reaches the user where they are: a warning points at the user's own line (whatever the path
through the package), and advice speaks the interface in use: Python arguments (``steps='auto'``) in Python, options
(``--steps auto``, ``--head``) on the command line."""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp import cli
from hf_geosharp.engine.result import command_line_words, setting
from hf_geosharp.measures import Settings, run_measures

from .fixtures.hf_models import one_thread, save_text_model, tiny_bert, tiny_tokenizer, write_csv  # noqa: F401

HERE = str(Path(__file__).resolve())


def _batches(n: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (4, 8), generator=g), "labels": torch.randint(0, 2, (4,), generator=g)}
            for _ in range(n)]


def _recorded(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


ENTRY_POINTS = {
    "geodesic_sharpness": lambda m, b: gs.geodesic_sharpness(m, b, rho=1.0, steps=1, progress=False),
    "adaptive_sharpness": lambda m, b: gs.adaptive_sharpness(m, b, rho=1.0, steps=1, progress=False),
    "run_measures": lambda m, b: run_measures(["geodesic_sharpness_inv"], m, b, Settings(rho=1.0, steps=1)),
    "hessian_top_eigenvalue": lambda m, b: gs.hessian_top_eigenvalue(m, b, max_iters=1, progress=False),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_not_converged_points_at_the_callers_line(entry):
    model = tiny_bert().double()
    caught = [w for w in _recorded(lambda: ENTRY_POINTS[entry](model, _batches()))
              if issubclass(w.category, gs.NotConvergedWarning)]
    assert caught, f"{entry} with one step should not be certified"
    assert {w.filename for w in caught} == {HERE}, [f"{w.filename}:{w.lineno}" for w in caught]


def test_no_symmetry_points_at_the_callers_line():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    batches = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))]

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    caught = _recorded(lambda: gs.geodesic_sharpness(mlp, batches, loss_fn=loss_fn, steps="auto", progress=False))
    notes = [w for w in caught if issubclass(w.category, gs.api.NoSymmetryWarning)]
    assert len(notes) == 1 and notes[0].filename == HERE


def test_half_precision_points_at_the_callers_line_and_names_the_fix_in_each_voice():
    model = tiny_bert().to(torch.bfloat16)
    python = [w for w in _recorded(lambda: gs.adaptive_sharpness(model, _batches(), steps=1, progress=False))
              if "computes in torch.bfloat16" in str(w.message)]
    assert len(python) == 1 and python[0].filename == HERE and "model.float()" in str(python[0].message)
    with command_line_words():
        shell = [w for w in _recorded(lambda: gs.adaptive_sharpness(model, _batches(), steps=1, progress=False))
                 if "computes in torch.bfloat16" in str(w.message)]
    assert "--dtype float32" in str(shell[0].message) and "model.float()" not in str(shell[0].message)


def test_settings_are_named_in_the_voice_of_the_interface():
    assert setting("steps", "auto") == "steps='auto'" and setting("max_steps") == "max_steps"
    with command_line_words():
        assert setting("steps", "auto") == "--steps auto" and setting("max_steps") == "--max-steps"
    assert setting("rho") == "rho"  # the block restores Python's words


def test_python_advice_names_python_arguments():
    caught = _recorded(lambda: gs.geodesic_sharpness(tiny_bert().double(), _batches(), rho=1.0, steps=1,
                                                     progress=False))
    (message,) = [str(w.message) for w in caught if issubclass(w.category, gs.NotConvergedWarning)]
    assert "pass steps='auto'" in message and "--steps" not in message


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import BertModel

    root = tmp_path_factory.mktemp("voice")
    headless = root / "headless"
    BertModel(tiny_bert().config).save_pretrained(headless)
    tiny_tokenizer(headless).save_pretrained(headless)
    return {"bert": save_text_model(root / "bert"), "csv": write_csv(root / "reviews.csv", 8), "headless": headless}


def test_the_command_line_names_options(files, capsys):
    argv = ["run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 4, "--batch-size", 4,
            "--measures", "inv", "--steps", 1, "--rho", 1.0, "--quiet"]
    caught = _recorded(lambda: cli.main([str(a) for a in argv]))
    said = capsys.readouterr().err + "\n".join(str(w.message) for w in caught)
    assert "is not converged after 1 steps" in said
    assert "pass --steps auto" in said and "steps='auto'" not in said


def test_a_model_without_a_head_is_told_about_head_on_the_command_line_and_loss_fn_in_python(files, capsys):
    argv = ["run", "--model", files["headless"], "--dataset", files["csv"], "--n-examples", 4, "--batch-size", 4]
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "geosharp run --head --num-labels N" in err and "loss_fn" not in err
    from hf_geosharp.data import DataError, load_model, require_task

    with pytest.raises(DataError, match="loss_fn=") as raised:
        require_task(load_model(str(files["headless"])))
    assert "--head" not in str(raised.value)


def test_register_says_which_module_cache_it_serves_and_what_to_do_under_another_hf_home(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.delenv("HF_MODULES_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cli.main(["register"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "hf" / "modules") in out and "under another HF_HOME run `geosharp register` again" in out
    assert "EVALUATE_MODULE_SCRIPT" in out


def test_the_readme_says_where_the_demos_caches_are(monkeypatch):
    """The zoo's cache and the results' cache (the demo's --out), as the code defaults them, are named in the README
    and docs/demo.md, so a reader knows which runs share them."""
    from hf_geosharp.zoo import cache_root

    monkeypatch.delenv("HF_GEOSHARP_CACHE", raising=False)
    out = cli.build_parser(["demo"]).parse_args(["demo"]).out
    zoo = "~/" + str((cache_root() / "zoo").relative_to(Path.home()))
    root = Path(__file__).resolve().parents[1]
    for page in (root / "README.md", root / "docs" / "demo.md"):
        text = page.read_text()
        assert f"`{zoo}`" in text and "HF_GEOSHARP_CACHE" in text and f"`{out}/" in text, page.name


def test_the_leaderboards_advice_speaks_the_readers_interface():
    from hf_geosharp.leaderboard import convergence_fix

    assert convergence_fix(20).startswith("steps='auto'") and "--rho" not in convergence_fix("auto")
    with command_line_words():
        assert convergence_fix(20).startswith("--steps auto") and "--rho" in convergence_fix("auto")


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SAYING = {"print", "error", "warning", "warn", "info", "exception"}


def _said(tree: ast.AST) -> Iterator[str]:
    """The text of every message a module prints, logs, warns, raises or returns (f-strings joined, their fields as
    ``{}``); command lines quoted in backticks (``geosharp run --json``, ``hf upload``) name other programs."""

    def text(node: ast.AST) -> str:
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        return node.value

    for node in ast.walk(tree):
        name = isinstance(node, ast.Call) and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
        if name in SAYING or isinstance(node, (ast.Raise, ast.Return)):
            parts = [n for n in ast.walk(node) if isinstance(n, ast.JoinedStr)
                     or isinstance(n, ast.Constant) and isinstance(n.value, str)]
            inside = {id(v) for n in parts if isinstance(n, ast.JoinedStr) for v in n.values}
            yield from (re.sub(r"`[^`]*`", "", text(n)) for n in parts if id(n) not in inside)


def _options() -> dict[str, tuple[str, frozenset[str]]]:
    parser = cli.build_parser(None)
    return {name: (module, cli.option_names(parser, name)) for name, (module, _) in cli.SUBCOMMANDS.items()}


def test_every_option_a_command_names_in_its_messages_is_one_it_has():
    """A command's errors, warnings and hints name only its own options (another program's go in backticks)."""
    wrong = []
    for name, (module, options) in _options().items():
        source = (Path(cli.__file__).parent / "commands" / f"{module}.py").read_text(encoding="utf-8")
        wrong += [(name, flag, said) for said in _said(ast.parse(source)) for flag in FLAG.findall(said)
                  if flag not in options]
    assert not wrong
    assert "--steps" in _options()["run"][1] and "--steps" not in _options()["reparametrize"][1]


@pytest.mark.parametrize("config", [
    {"steps": 20, "max_steps": 640, "rho": 0.1},  # fixed steps: pass steps auto
    {"steps": "auto", "max_steps": 640, "rho": 0.1},  # the budget ran out: lower rho, or raise it from Python
])
def test_engine_advice_names_only_the_running_commands_options(config):
    """The solver's not-converged advice, inside each command: its options where it has them (``--steps auto`` in
    ``run``), the Python argument where it has none (``reparametrize`` has no ``--steps``)."""
    from hf_geosharp.engine.result import warn_not_converged

    for name, (_, options) in _options().items():
        with command_line_words(options):
            caught = _recorded(lambda: warn_not_converged("adaptive_clean_worst", config, "the gap is 1 %", 20))
        (message,) = [str(w.message) for w in caught]
        assert set(FLAG.findall(message)) <= options, (name, message)
        if config["steps"] == 20:
            assert ("--steps auto" in message) == ("--steps" in options), (name, message)
            assert ("steps='auto' (from Python)" in message) == ("--steps" not in options), (name, message)
