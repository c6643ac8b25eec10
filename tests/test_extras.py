"""Every extra the documentation names exists in pyproject.toml, and every documented command that needs an extra's
package names that extra beside it (within a few lines), so that it runs after the install the text gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "metric_card" / "README.md", *(REPO / "docs").glob("*.md")])
EXTRAS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])

#: How a page names extras: ``pip install "hf_geosharp[a,b]"``, ``-e ".[a]"``, ``bash scripts/install.sh a,b`` and
#: "the `a` extra", and the rows of a table whose first column is headed "extra" (docs/install.md).
NAMING = (r"hf_geosharp\[([\w,-]+)\]", r"\.\[([\w,-]+)\]", r"scripts/install\.sh ([\w,-]+)", r"`([\w-]+)` extras?\b")
TABLE = re.compile(r"^\| extra \|.*?(?:\n(?!\|).*|\Z)", re.S | re.M)
#: Documented commands that need an extra's package, and that extra.
NEEDS = {r"python\S* spaces_demo/app\.py": "space", r"geosharp export-space DIR": "space",
         r"report_to=\"tensorboard\"": "tensorboard", r"\bmkdocs (serve|build)": "test"}
#: How far from such a command (in lines) the page must name its extra.
NEAR = 8


def _named(text: str) -> set[str]:
    rows = {row for table in TABLE.findall(text) for row in re.findall(r"^\| `([\w-]+)` \|", table, re.M)}
    return rows | {extra for pattern in NAMING for group in re.findall(pattern, text) for extra in group.split(",")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_extra_a_page_names_exists(page: Path) -> None:
    named = _named(page.read_text())
    assert named <= EXTRAS, f"{page.relative_to(REPO)} names extras pyproject.toml lacks: {sorted(named - EXTRAS)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_command_that_needs_an_extra_names_it_beside_it(page: Path) -> None:
    lines = page.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        for pattern, extra in NEEDS.items():
            if re.search(pattern, line) and extra not in _named("\n".join(lines[max(0, i - NEAR): i + NEAR + 1])):
                missing.append(f"line {i + 1}: {pattern} without the `{extra}` extra")
    assert not missing, f"{page.relative_to(REPO)}: {missing}"


def test_the_scan_finds_what_the_readme_documents() -> None:
    """The patterns are live: the README names the Space's and TensorBoard's extras, and a page naming an extra that
    does not exist is caught."""
    readme = (REPO / "README.md").read_text()
    assert {"space", "tensorboard", "test"} <= _named(readme)
    assert _named('pip install "hf_geosharp[spaces]"') - EXTRAS == {"spaces"}
