"""``geosharp --help`` starts fast: the package root, the CLI and its parser import neither torch nor transformers;
a command's module (and with it the engine) is imported only when that command runs."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_geosharp import cli

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "evaluate", "accelerate", "gradio", "matplotlib", "scipy")


def _imported_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import hf_geosharp",
    "import hf_geosharp.cli",
    "import contextlib, io, hf_geosharp.cli as c\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    "    try: c.main(['--help'])\n    except SystemExit: pass",
    "import contextlib, io, hf_geosharp.cli as c\nwith contextlib.redirect_stderr(io.StringIO()):\n"
    "    try: c.main(['no-such-command'])\n    except SystemExit: pass",
])
def test_the_package_and_the_help_import_no_heavy_library(code):
    assert _imported_after(code) == []


def test_a_command_imports_its_module_and_the_engine_only_when_it_runs():
    assert "torch" in _imported_after("import hf_geosharp.cli as c\nc.build_parser(['run', '--model', 'm'])")
    assert "torch" in _imported_after("import hf_geosharp as gs\ngs.geodesic_sharpness")


def test_the_listed_commands_are_the_commands_modules_declare():
    """``geosharp --help`` lists SUBCOMMANDS; each command's own parser (its module's ``add_parser``) declares the
    same name and help, so the two cannot drift apart."""
    full = cli.build_parser()
    (sub,) = [a for a in full._actions if a.__class__.__name__ == "_SubParsersAction"]
    declared = {action.dest: action.help for action in sub._choices_actions}
    assert declared == {name: text for name, (_, text) in cli.SUBCOMMANDS.items()}


def test_help_lists_every_command_and_a_command_gets_its_own_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in cli.SUBCOMMANDS)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-v", "run", "--help"])
    assert exit_.value.code == 0 and "--model" in capsys.readouterr().out


def test_gs_hide_is_the_function_also_after_its_sub_package_is_imported():
    import hf_geosharp as gs
    import hf_geosharp.hiding.seek  # noqa: F401
    from hf_geosharp.hiding.transform import hide

    assert gs.hide is hide and callable(gs.hide)
    with pytest.warns(DeprecationWarning, match=r"hf_geosharp\.hide\.seek is deprecated.*import hf_geosharp\.hiding"):
        import hf_geosharp.hide.seek  # noqa: F401  (the old name; the import system sets the package's ``hide``)
    from hf_geosharp.hide.seek import hide_and_seek  # the same module under its old name

    assert gs.hide is hide and hide_and_seek is hf_geosharp.hiding.seek.hide_and_seek
    with pytest.warns(DeprecationWarning, match=r"hf_geosharp\.hide is deprecated.*import hf_geosharp\.hiding\."):
        importlib.reload(sys.modules["hf_geosharp.hide"])  # the package's own warning, also where it stands alone
    from hf_geosharp.hide import HideResult
    from hf_geosharp.hide import hide as old_hide

    assert old_hide is hide and HideResult is hf_geosharp.hiding.HideResult and gs.hide is hide


def test_importing_the_package_installs_no_import_hook():
    """The old name is a plain sub-package (``hf_geosharp/hide/``), not an import hook added at import."""
    code = ("import sys; before = list(sys.meta_path); import hf_geosharp; "
            "assert sys.meta_path == before, sys.meta_path; assert 'hf_geosharp.hide' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
