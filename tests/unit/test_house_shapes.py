"""The shapes the package keeps so that a newcomer finds one home per idea: the time plan's one face
and its size, the objectives' short registry, one FSDP layout file, DeepSpeed and FSDP2's private
names each behind one door. Read from the source (AST), so a change that spreads one of them again
fails here, naming the file."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cputrain"


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports from, anywhere in it (`from a.b import c` counts as a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_time_plan_stays_within_its_size_and_one_face():
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / "plan" / "time").glob("*.py"))
    assert lines <= 1700, f"cputrain/plan/time/ is {lines} lines (at most 1,700)"
    outside = [f"{p.relative_to(PACKAGE)}: {m}" for p in _sources() if "plan" not in p.relative_to(PACKAGE).parts[:1]
               for m in _imported_modules(p) if m.startswith("cputrain.plan.time.")]
    assert not outside, f"import cputrain.plan.time (its face), not its modules: {outside}"


def test_plan_step_time_is_one_short_function():
    tree = ast.parse((PACKAGE / "plan" / "time" / "step_time.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "plan_step_time"]
    params = len(fn.args.args) + len(fn.args.kwonlyargs)
    assert params <= 6 and fn.end_lineno - fn.lineno + 1 <= 70, (params, fn.end_lineno - fn.lineno + 1)
    nested = [n.name for top in tree.body if isinstance(top, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(top)
              if n is not top and isinstance(n, ast.FunctionDef) and not isinstance(top, ast.ClassDef)]
    assert not nested, f"nested functions in plan/time/step_time.py: {nested}"


def test_the_objectives_registry_is_short():
    lines = len((PACKAGE / "objectives" / "objective.py").read_text().splitlines())
    assert lines <= 40, f"cputrain/objectives/objective.py is {lines} lines (at most 40: one registry line each)"


def test_one_fsdp_layouts_file_and_one_door_each_to_deepspeed_and_fsdp2s_private_names():
    layout_files = [p.relative_to(PACKAGE) for p in _sources() if "fsdp_layouts" in p.name]
    assert [str(p) for p in layout_files] == ["parallel/fsdp_layouts.py"], layout_files
    deepspeed = [p.relative_to(PACKAGE) for p in _sources()
                 if any(m == "deepspeed" or m.startswith("deepspeed.") for m in _imported_modules(p))]
    assert [str(p) for p in deepspeed] == ["parallel/zero3.py"], f"deepspeed imported by {deepspeed}"
    private = [p.relative_to(PACKAGE) for p in _sources()
               if any(m.startswith("torch.distributed.fsdp._") for m in _imported_modules(p))]
    assert [str(p) for p in private] == ["parallel/fsdp2_private.py"], f"FSDP2's private modules imported by {private}"
