"""docs/architecture.md lists every module of cputrain/, layer by layer, as the tree and
tests/unit/test_layers.py's LAYERS have them; a module added, removed or moved fails here, naming
the row to add or remove.

The page's shape, which this test reads:

- one section per layer, in LAYERS' order, headed `## Layer N: unit, unit` (N counts from 1; the
  units are LAYERS[N-1], in any order, backticks allowed);
- in a layer's section, one table row per module, beginning with the module's path under
  cputrain/ in backticks: | `model/skeleton.py` | what it holds |
- every module has a row in its own layer's section. A package's `__init__.py` needs a row only
  where it holds more than its docstring (an import, a definition); the package's own
  cputrain/__init__.py belongs to no layer and needs none;
- no table cell on the page runs over 400 characters: a module holding more gets a shorter row
  or a paragraph under the table.

To add a module: add a row `| `unit/module.py` | what it holds |` to the table of its unit's layer.
A new top-level unit goes into LAYERS (test_layers.py) and into the heading of its layer here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "cputrain"
MAX_CELL_CHARS = 400

LAYER_HEADING = re.compile(r"^## Layer (\d+): (.+?)\s*$")
MODULE_ROW = re.compile(r"^\|\s*`([\w/]+\.py)`")


def _layers() -> list[list[str]]:
    """LAYERS as tests/unit/test_layers.py holds it: the one list of the layering."""
    spec = importlib.util.spec_from_file_location("_layers_of_the_package", Path(__file__).with_name("test_layers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def modules_in_tree(package: Path = PACKAGE) -> dict[str, bool]:
    """Every module under cputrain/, by path, and whether the page must list it (an `__init__.py` only
    where it holds code; the package's own never)."""
    found = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).as_posix()
        found[rel] = not (rel == "__init__.py" or (path.name == "__init__.py" and _only_a_docstring(path)))
    return found


def unit_of(rel: str) -> str:
    """model/skeleton.py → model; cli.py → cli."""
    first = rel.split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def page_sections(text: str) -> list[tuple[int, list[str], list[str]]]:
    """(layer number, its units, the modules of its rows) for each `## Layer N:` section, in page order."""
    sections = []
    for line in text.splitlines():
        heading = LAYER_HEADING.match(line)
        if heading:
            units = [u.strip().strip("`") for u in heading.group(2).split(",")]
            sections.append((int(heading.group(1)), units, []))
        elif line.startswith("## "):
            sections.append((0, [], []))  # another section: its rows are no layer's
        else:
            row = MODULE_ROW.match(line)
            if row and sections:
                sections[-1][2].append(row.group(1))
    return [s for s in sections if s[0]]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def long_cells(text: str, limit: int = MAX_CELL_CHARS) -> list[str]:
    return [f"line {number}: {len(cell)} characters: {cell[:60]}…"
            for number, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith("|")
            for cell in _cells(line) if len(cell) > limit]


def problems(text: str, tree: dict[str, bool], layers: list[list[str]]) -> list[str]:
    found = []
    required = {rel for rel, must in tree.items() if must}
    sections = page_sections(text)
    on_page = [(number, units, rel) for number, units, rels in sections for rel in rels]
    listed = {rel for _, _, rel in on_page}
    for rel in sorted(required - listed):
        unit = unit_of(rel)
        where = next((f"## Layer {i + 1}" for i, units in enumerate(layers) if unit in units), "its layer's section")
        found.append(f"not on the page: cputrain/{rel}; add the row | `{rel}` | what it holds | under {where}")
    for number, _, rel in on_page:
        if rel not in tree:
            found.append(f"on the page but not in the tree: cputrain/{rel}; remove its row from ## Layer {number} "
                         "(or fix its path)")
    headed = [(number, sorted(units)) for number, units, _ in sections]
    wanted = [(i + 1, sorted(units)) for i, units in enumerate(layers)]
    if headed != wanted:
        found.append("the layer sections differ from LAYERS (tests/unit/test_layers.py): the page has "
                     + "; ".join(f"{n}: {', '.join(u)}" for n, u in headed) + " — LAYERS has "
                     + "; ".join(f"{n}: {', '.join(u)}" for n, u in wanted)
                     + "; head each layer `## Layer N: unit, unit` in LAYERS' order")
    for number, units, rel in on_page:
        if unit_of(rel) not in units:
            found.append(f"cputrain/{rel} is listed under ## Layer {number} ({', '.join(units)}), "
                         f"not under its unit {unit_of(rel)}'s layer: move its row")
    found += [f"a table cell over {MAX_CELL_CHARS} characters ({c}): split it into rows or a paragraph"
              for c in long_cells(text)]
    return found


def test_the_page_lists_every_module_of_the_tree_in_its_layer():
    found = problems(PAGE.read_text(), modules_in_tree(), _layers())
    assert not found, f"{PAGE.relative_to(REPO)} and the tree differ:\n" + "\n".join(found)


def test_the_page_has_a_section_per_layer_and_rows_in_them():
    sections = page_sections(PAGE.read_text())
    assert len(sections) == len(_layers())
    assert all(rels for _, _, rels in sections), "a layer section without module rows"


def test_the_check_names_what_to_add_and_remove(tmp_path):
    """The check itself can fail: a module missing from the page, a row for no module, layers out of
    order and a long cell are each reported, naming the path or the line."""
    package = tmp_path / "cputrain"
    tree = {"__init__.py": '"""the package"""\n__version__ = "0"\n', "errors.py": "",
            "kernels/__init__.py": '"""kernels"""\nfrom x import y\n', "model/__init__.py": '"""the model"""\n',
            "model/skeleton.py": "", "model/new_part.py": ""}
    for rel, text in tree.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    layers = [["errors", "kernels"], ["model"]]
    page = ("## Layer 2: model\n\n| module | what |\n| --- | --- |\n| `model/skeleton.py` | the skeleton |\n"
            "| `model/gone.py` | a module no longer there |\n\n"
            "## Layer 1: errors\n\n| module | what |\n| --- | --- |\n| `errors.py` | " + "x" * 401 + " |\n")
    found = problems(page, modules_in_tree(package), layers)
    text = "\n".join(found)
    assert "not on the page: cputrain/model/new_part.py; add the row | `model/new_part.py` |" in text
    assert "under ## Layer 2" in text
    assert "on the page but not in the tree: cputrain/model/gone.py; remove its row from ## Layer 2" in text
    assert "the layer sections differ from LAYERS" in text
    assert "a table cell over 400 characters (line 12: 401 characters" in text
    assert "add the row | `kernels/__init__.py` |" in text, "an __init__.py that holds code needs a row"
    assert "cputrain/__init__.py" not in text and "model/__init__.py" not in text, \
        "a docstring-only __init__.py and the package's own need no row"
    assert len(found) == 5, found
