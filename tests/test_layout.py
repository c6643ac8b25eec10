"""The layout docs/architecture.md describes, held against the code: the engine imports no face, its lowest layers
import only each other (torch, the defaults), private APIs stay in their one adapter each, and the package root
holds the public API and little else. Read from the source with ``ast``: nothing is imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_geosharp"
FACES = ("api", "measures", "cli", "zoo", "lm_zoo", "text_corpus", "commands", "data", "evaluate_module", "hub",
         "leaderboard", "hiding", "integrations", "plots", "pipeline")
#: The faces proper: they parse inputs into the pipeline's request and format its results (docs/architecture.md).
FACE_FILES = sorted({*(PACKAGE / "commands").rglob("*.py"), *(PACKAGE / "evaluate_module").rglob("*.py"),
                     *(PACKAGE / "hub").rglob("*.py"), *(PACKAGE / "leaderboard").rglob("*.py"),
                     *(PACKAGE / "integrations").rglob("*.py"), PACKAGE / "hiding" / "seek.py",
                     *(PACKAGE.parent / "spaces_demo").rglob("*.py"), *(PACKAGE.parent / "experiments").rglob("*.py")})
#: The engine's lowest layers: torch (numpy), the defaults and the device paths at most.
LOWEST = ("engine/defaults.py", "engine/device_paths.py", "engine/geometry/elementwise.py",
          "engine/geometry/gl_quotient.py", "engine/geometry/lie.py", "engine/space/workspace.py",
          "engine/model_function/embedding_rows.py", "engine/solvers/apgd.py", "engine/solvers/as23.py",
          "engine/solvers/average.py", "engine/solvers/certificate.py", "engine/solvers/interface.py",
          "engine/solvers/memory.py", "engine/solvers/pool.py", "engine/solvers/schedule.py", "engine/solvers/climb.py",
          "engine/solvers/device_climb.py", "engine/checks.py", "engine/result.py", "engine/capture.py")


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
    named = set(re.findall(r"`((?:engine|symmetry|hub|leaderboard|hiding|pipeline|evaluate_module)/[\w/]+\.py)`", doc))
    assert named, "the doc names no module"
    missing = sorted(n for n in named if not (PACKAGE / n).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_import_reader_sees_relative_absolute_and_lazy_imports() -> None:
    """The negative control of the rules above: the reader finds what a face imports from the engine, and the
    builder's lazy import of the mapper."""
    assert "engine.symmetry_search" in _imports(PACKAGE / "hiding" / "transform.py")
    assert "symmetry.map_symmetries" in _imports(PACKAGE / "engine" / "builder.py")
    assert "engine" in {name.split(".")[0] for name in _imports(PACKAGE / "api.py")}


def _where(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


#: Experiments that study the solver itself (its certificate, against an exact oracle), not faces of a measurement.
SOLVER_STUDIES = ("experiments/exact_geodesic.py",)


@pytest.mark.parametrize("path", FACE_FILES, ids=_where)
def test_no_face_imports_the_solver(path: Path) -> None:
    """The solver is the engine's: a face asks the pipeline (its time estimate included) or the registry."""
    if _where(path) in SOLVER_STUDIES:
        pytest.skip("a study of the solver")
    solver = {name for name in _imports(path) if name.startswith("engine.solvers")}
    assert not solver, f"{_where(path)} imports {sorted(solver)}"


#: A call of the mapper by its bare name (``gs.map_symmetries(...)``, the public API, is a qualified one).
BARE_MAP_CALL = re.compile(r"(?<![\w.])map_symmetries\(")


@pytest.mark.parametrize("path", FACE_FILES, ids=_where)
def test_faces_map_symmetries_only_through_the_pipeline_or_the_public_api(path: Path) -> None:
    text = path.read_text()
    mapper = {name for name in _imports(path) if name in ("symmetry.map_symmetries", "symmetry.mapping")}
    assert not mapper and not BARE_MAP_CALL.search(text), \
        f"{_where(path)} maps symmetries itself; ask hf_geosharp.pipeline (prepare, symmetry_map) or gs.map_symmetries"


def test_the_rules_above_see_what_they_forbid() -> None:
    """Negative control: the pipeline maps the symmetries and imports the solver, and the readers see both."""
    pipeline = PACKAGE / "pipeline" / "measuring.py"
    assert BARE_MAP_CALL.search(pipeline.read_text())
    assert "engine.solvers.apgd" in _imports(pipeline)
    assert "symmetry.map_symmetries" in _imports(pipeline)


def _submodules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


#: Sub-packages kept only as a deprecated old name (a shim that warns and re-exports the renamed package).
DEPRECATED_NAMES = {"hide"}


@pytest.mark.parametrize("package", sorted(p.parent for p in PACKAGE.rglob("__init__.py")), ids=_where)
def test_no_module_is_shadowed_by_a_name_its_package_exports(package: Path) -> None:
    """``from .hide import hide`` in a package makes ``package.hide`` the function, so the dotted path of anything
    else in that module (a docstring's reference, an API page) cannot be reached."""
    bound = set()
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom):
            bound |= {alias.asname or alias.name for alias in node.names}
    if package == PACKAGE:  # the root's public names are imported lazily (``_PUBLIC``)
        tree = ast.parse((package / "__init__.py").read_text())
        public = next(n for n in tree.body if isinstance(n, ast.AnnAssign | ast.Assign)
                      and "_PUBLIC" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target))
        bound |= set(ast.literal_eval(public.value))
        bound -= DEPRECATED_NAMES  # the old path only re-exports the new one; ``_Package`` keeps ``gs.hide`` in front
    shadowed = sorted(bound & _submodules(package) - {name for name in bound if _is_module_import(package, name)})
    assert not shadowed, f"{_where(package)}: {shadowed} name both a module and something else"


def _is_module_import(package: Path, name: str) -> bool:
    """Whether the package's ``name`` is bound to the sub-module itself (``from . import name``)."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
            if any((a.asname or a.name) == name for a in node.names):
                return True
    return False


def test_settings_are_declared_once() -> None:
    """The shared settings are the fields of ``measures.Settings`` (the engine's are ``RunSettings``'s); the command
    lines take their options from it (``commands/common.py``), and each constant has one definition."""
    declared = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == "rho"
                    for s in node.body):
                declared[node.name] = str(path.relative_to(PACKAGE))
    assert declared == {"Settings": "measures.py", "RunSettings": "engine/settings.py"}, declared
    for command in ("run.py", "board.py"):
        text = (PACKAGE / "commands" / command).read_text()
        for flag in ("--rho", "--steps", "--n-samples", "--epsilon", "--seed", "--mode", "--measures"):
            assert f'"{flag}"' not in text, f"commands/{command} declares {flag}; commands/common.py declares it once"
    for constant in ("ZERO_TOL",):
        defined = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if re.search(rf"^{constant}\s*(:[^=]*)?=", p.read_text(), re.MULTILINE)]
        assert defined == ["engine/defaults.py"], (constant, defined)


def _defined(path: Path) -> set[str]:
    """The functions and classes ``path`` defines (at any depth)."""
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def test_one_meaning_per_name() -> None:
    """The vocabulary docs/architecture.md's "Names" gives each word is the code's: the names it cites are defined
    where it says, and the names that once meant several things (a measure's key against its engine name: ``key_of``,
    ``result_name``, ``measure_key``) are defined nowhere in the package."""
    cited = {"measures.py": {"engine_name", "key_of_engine_name", "Settings"}, "hub/cards.py": {"key_of_result"},
             "pipeline/measuring.py": {"measure"}, "engine/runner.py": {"run"}, "engine/settings.py": {"RunSettings"},
             "engine/placement/sharding.py": {"attention_placement"}}
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text().split("### Names", 1)[1].split("\n## ", 1)[0]
    for relative, names in cited.items():
        assert names <= _defined(PACKAGE / relative), (relative, names - _defined(PACKAGE / relative))
        assert all(name in doc for name in names), names
    assert "App" in _defined(PACKAGE.parent / "spaces_demo" / "app.py") and "`App`" in doc
    retired = {"key_of", "result_name", "measure_key"}
    for path in PACKAGE.rglob("*.py"):
        assert not retired & _defined(path), f"{_where(path)} defines {sorted(retired & _defined(path))}"
