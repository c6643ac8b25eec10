"""The layout docs/architecture.md describes, held against the code: the engine imports no face, its lowest layers
import only each other (torch, the defaults), private APIs stay in their one adapter each, and the package root
holds the public API and little else. Read from the source with ``ast``: nothing is imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_geosharp"
FACES = ("api", "measures", "cli", "zoo", "commands", "data", "evaluate_module", "hub", "leaderboard", "hide",
         "integrations", "plots")
#: The engine's lowest layers: torch (numpy) and the defaults at most.
LOWEST = ("engine/defaults.py", "engine/geometry/elementwise.py", "engine/geometry/gl_quotient.py",
          "engine/geometry/lie.py", "engine/space/workspace.py", "engine/model_function/embedding_rows.py",
          "engine/solvers/apgd.py", "engine/solvers/as23.py", "engine/solvers/average.py",
          "engine/solvers/certificate.py", "engine/solvers/interface.py", "engine/solvers/memory.py",
          "engine/solvers/pool.py", "engine/solvers/schedule.py", "engine/solvers/climb.py",
          "engine/solvers/device_climb.py", "engine/checks.py", "engine/result.py")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package's modules (dotted, ``hf_geosharp.`` stripped) that ``path`` imports, lazily or not."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + [f"{name}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {n.removeprefix("hf_geosharp.") for n in names if n == "hf_geosharp" or n.startswith("hf_geosharp.")}
    return found


ENGINE = sorted((PACKAGE / "engine").rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_engine_imports_no_face(path: Path) -> None:
    faces = {name for name in _imports(path) if name.split(".")[0] in FACES}
    assert not faces, f"{path.relative_to(PACKAGE)} imports faces {sorted(faces)}"


@pytest.mark.parametrize("relative", LOWEST)
def test_the_lowest_layers_import_only_each_other(relative: str) -> None:
    lowest = tuple(path.removesuffix(".py").replace("/", ".") for path in LOWEST)
    imported = {name for name in _imports(PACKAGE / relative)
                if name not in ("hf_geosharp", "engine") and not name.startswith(lowest)}
    assert not imported, f"{relative} imports {sorted(imported)}"


def test_the_symmetry_map_takes_only_the_lie_algebras_and_the_defaults_from_the_engine() -> None:
    for path in sorted((PACKAGE / "symmetry").rglob("*.py")):
        engine = {name for name in _imports(path) if name.startswith("engine")}
        assert all(name.startswith(("engine.geometry.lie", "engine.defaults")) for name in engine), \
            f"{path.relative_to(PACKAGE)} imports {sorted(engine)}"


def test_private_torch_apis_stay_in_their_one_adapter_each() -> None:
    users = {"_reparametrize_module": set(), "_sharded_param_data": set(), "_lazy_init": set()}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for name in users:
            if re.search(rf"\b{name}\b", text):
                users[name].add(str(path.relative_to(PACKAGE)))
    assert users["_reparametrize_module"] == {"engine/placement/single.py"}
    assert users["_sharded_param_data"] <= {"engine/placement/fsdp_internals.py"}
    assert users["_lazy_init"] <= {"engine/placement/fsdp_internals.py"}


def test_the_package_root_holds_at_most_twelve_modules() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, modules


def test_every_module_the_architecture_doc_names_exists() -> None:
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:engine|symmetry|hub|leaderboard|hide|evaluate_module)/[\w/]+\.py)`", doc))
    assert named, "the doc names no module"
    missing = sorted(n for n in named if not (PACKAGE / n).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_import_reader_sees_relative_absolute_and_lazy_imports() -> None:
    """The negative control of the rules above: the reader finds what a face imports from the engine, and the
    builder's lazy import of the mapper."""
    assert "engine.symmetry_search" in _imports(PACKAGE / "hide" / "transform.py")
    assert "symmetry.map_symmetries" in _imports(PACKAGE / "engine" / "builder.py")
    assert "engine" in {name.split(".")[0] for name in _imports(PACKAGE / "api.py")}
