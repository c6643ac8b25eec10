"""The documentation site: every guide in docs/ is in mkdocs.yml's navigation, the API reference documents every
public name, and every public function and method (of ``hf_geosharp`` and of each sub-package's ``__all__``) says what
it takes (Args) and what it gives (Returns)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import math
import pkgutil
import re
from pathlib import Path

import pytest

import hf_geosharp as gs

REPO = Path(__file__).resolve().parents[1]
MKDOCS = (REPO / "mkdocs.yml").read_text()
API = (REPO / "docs" / "api.md").read_text()
#: Public names that are not functions or classes (documented in docs/api.md's prose).
DATA = {"__version__", "EVALUATE_MODULE_DIR", "EVALUATE_MODULE_SCRIPT"}
#: Public names outside ``__all__``: imported with transformers on first use (``hf_geosharp.__getattr__``).
LAZY = ("GeodesicSharpnessCallback", "measure_trainer")


def _public_objects() -> dict[str, object]:
    return {name: getattr(gs, name) for name in [*gs.__all__, *LAZY] if name not in DATA}


def test_every_guide_is_in_the_navigation():
    nav = set(re.findall(r":\s*([\w/]+\.md)\s*$", MKDOCS, re.M))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == nav, f"in docs/ but not in mkdocs.yml's nav: {pages - nav}; in nav, missing: {nav - pages}"


def test_the_api_reference_documents_every_public_name():
    documented = {line.rsplit(".", 1)[1] for line in re.findall(r"^::: ([\w.]+)$", API, re.M)}
    assert set(_public_objects()) <= documented, set(_public_objects()) - documented
    for path in re.findall(r"^::: ([\w.]+)$", API, re.M):  # the documented object is the one users import
        module, name = path.rsplit(".", 1)
        assert getattr(__import__(module, fromlist=[name]), name) is getattr(gs, name)
    assert all(f"gs.{name}" in API for name in DATA - {"__version__"})


#: Sub-packages kept only as a deprecated old name (they re-export another sub-package, checked there).
DEPRECATED = {"hide"}


def _subpackage_objects() -> dict[str, object]:
    """What each sub-package exports (its ``__all__``): what its sibling packages and users call."""
    found = {}
    for info in pkgutil.iter_modules(gs.__path__):
        if info.ispkg and info.name not in DEPRECATED:
            package = importlib.import_module(f"hf_geosharp.{info.name}")
            found.update({f"{info.name}.{name}": getattr(package, name) for name in getattr(package, "__all__", ())})
    return found


def _callables(objects: dict[str, object]) -> dict[str, object]:
    found = {}
    for name, obj in objects.items():
        if inspect.isclass(obj):
            found.update({f"{name}.{m}": f for m, f in vars(obj).items()
                          if inspect.isfunction(f) and not m.startswith("_")})
        elif inspect.isfunction(obj):
            found[name] = obj
    return found


def test_the_sub_packages_are_read():
    """Negative control of the test below: it reads every sub-package's exports, the deprecated name's aside."""
    names = {name.split(".")[0] for name in _subpackage_objects()}
    assert {"data", "hiding", "integrations", "leaderboard", "pipeline", "symmetry"} <= names and "hide" not in names
    assert "leaderboard.run_leaderboard" in _callables(_subpackage_objects())


@pytest.mark.parametrize("objects", [_public_objects, _subpackage_objects], ids=["hf_geosharp", "sub-packages"])
def test_every_public_function_has_args_and_returns(objects):
    missing = []
    for name, fn in _callables(objects()).items():
        doc = inspect.getdoc(fn) or ""
        signature = inspect.signature(fn)
        params = [p for p in signature.parameters if p not in ("self", "cls")]
        if params and "Args:" not in doc:
            missing.append(f"{name}: Args")
        for param in params:  # each argument by its own name, so the reference can check it against the signature
            star = {"VAR_KEYWORD": "**", "VAR_POSITIONAL": "*"}.get(signature.parameters[param].kind.name, "")
            if params and not re.search(rf"^\s+{re.escape(star + param)}( \(.*\))?:", doc, re.M):
                missing.append(f"{name}: {param}")
        returns = signature.return_annotation
        if returns is inspect.Signature.empty:  # "unless it returns None" is read from the annotation
            missing.append(f"{name}: return annotation")
        elif returns not in (None, "None") and "Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert not missing, missing


def test_the_home_page_has_the_readmes_quick_start_and_the_guides_link_both_ways():
    """docs/index.md, the site's home, shows the README's set-up commands and its example as they are (the README's
    tests run and check them), and the guide, the README and the home page link one another."""
    readme = (REPO / "README.md").read_text()
    index = (REPO / "docs" / "index.md").read_text()
    guide = (REPO / "docs" / "guide.md").read_text()
    setup = readme.split("\n## Set-up: two commands\n", 1)[1].split("\n## ", 1)[0]
    example = readme.split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    blocks = [re.findall(r"^```bash\n.*?^```\n", setup, re.S | re.M)[0],
              re.findall(r"^```python\n.*?^```\n", example, re.S | re.M)[0]]
    quick_start = index.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert all(block in quick_start for block in blocks), "docs/index.md's quick start differs from the README's"
    assert "](guide.md)" in index and "](docs/guide.md)" in readme
    assert guide.count("](index.md#quick-start)") >= 1 and "README's example:" not in guide


def test_the_guides_python_example_runs(capsys):
    """docs/guide.md's first example (every measure of the Python API) runs as written on a model and batches of the
    kind it names, and prints one line of the values it says."""
    from .fixtures.intact import tiny_batches, tiny_bert

    guide = (REPO / "docs" / "guide.md").read_text()
    code = re.findall(r"^```python\n(.*?)^```", guide, re.S | re.M)[0]
    namespace = {"model": tiny_bert(), "batches": tiny_batches(n=1)}
    exec(compile(code, "docs/guide.md (python block 1)", "exec"), namespace)
    value, stderr, converged, per_batch, *others = capsys.readouterr().out.split(" ", 3)
    assert float(value) > 0 and converged in ("True", "False") and namespace["res"].per_batch == [float(value)]
    assert namespace["base"].value > 0 and namespace["flat"].value > 0 and namespace["smap"].summary()["n_pairs_qk"]


def _griffe_package(*extensions: str):
    """The package as the API reference's generator (mkdocstrings' griffe) reads it, with ``extensions``."""
    griffe = pytest.importorskip("griffe")  # the `test` extra
    loader = griffe.GriffeLoader(extensions=griffe.load_extensions(*extensions), search_paths=[str(REPO)])
    return loader.load("hf_geosharp")


def _documented_defaults(package) -> dict[str, tuple[str, object]]:
    """Every default the API reference shows (each documented function's and class's signatures, methods included),
    as the page writes it, with the value Python's signature holds."""
    found = {}
    for path in re.findall(r"^::: hf_geosharp\.([\w.]+)$", API, re.M):
        documented, runtime = package[path], getattr(gs, path.rsplit(".", 1)[1])
        pairs = [(documented, runtime)]
        if documented.is_class:
            pairs = [(member, getattr(runtime, name)) for name, member in documented.members.items()
                     if member.is_function and name in vars(runtime) and (name == "__init__" or name[0] != "_")]
        for func, obj in pairs:
            parameters = inspect.signature(obj).parameters
            for parameter in func.parameters:
                kind = parameters.get(parameter.name, None)
                if parameter.default is not None and kind is not None and kind.kind.name != "VAR_KEYWORD":
                    found[f"{func.path}({parameter.name})"] = (str(parameter.default),
                                                             parameters[parameter.name].default)
    return found


def test_the_api_reference_shows_defaults_as_values():
    """The reference's signatures and Default columns show ``rho = 0.1``, not the constant's name ``RHO``: mkdocs.yml's
    griffe extension (scripts/griffe_defaults.py) writes each default as the value Python's signature holds."""
    assert "scripts/griffe_defaults.py:ConstantDefaults" in MKDOCS
    shown = _documented_defaults(_griffe_package("scripts/griffe_defaults.py:ConstantDefaults"))
    assert shown["hf_geosharp.api.geodesic_sharpness(rho)"] == ("0.1", 0.1)
    assert len(shown) > 50, "the reference's signatures are read"
    wrong = [f"{where}: shows {written}, Python's default is {value!r}" for where, (written, value) in shown.items()
             if not _the_value(written, value)]
    assert not wrong, wrong


#: Defaults the reference shows as expressions a reader knows (a dataclass field's factory, NaN), with their check.
EXPRESSIONS = {"list()": lambda v: v is dataclasses.MISSING or "factory" in repr(v),
               "dict()": lambda v: v is dataclasses.MISSING or "factory" in repr(v),
               "math.nan": lambda v: isinstance(v, float) and math.isnan(v)}


def _the_value(written: str, value: object) -> bool:
    """Whether ``written``, a default as the reference shows it, is ``value``: a literal equal to it, or one of
    ``EXPRESSIONS`` that stands for it (a name of a constant is neither)."""
    if written in EXPRESSIONS:
        return EXPRESSIONS[written](value)
    try:
        return ast.literal_eval(written) == value
    except (ValueError, SyntaxError):
        return False


def test_without_the_extension_the_reference_shows_names():
    """The negative control of the test above: griffe alone renders the source's expression, the constant's name."""
    shown = _documented_defaults(_griffe_package())
    assert shown["hf_geosharp.api.geodesic_sharpness(rho)"] == ("RHO", 0.1)
