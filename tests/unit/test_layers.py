"""The package is layered: every import in cputrain/ goes down the list below, never up, and no
modules import each other in a circle. Read from the source (every import statement, also those
inside functions), so a new upward import or a new circle fails here, naming it.

A new top-level module or subpackage must be placed in LAYERS: where it goes says what it may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cputrain"

# Lowest first. A unit (a top-level module or a subpackage) may import units of lower layers, and
# modules of its own unit; nothing in its own layer or above.
LAYERS = [
    ["errors", "log", "hardware", "kernels", "native"],  # facts, kernels, native libraries: no project imports
    ["config", "locks"],  # the config: sections, YAML and overrides, the machine's "auto"s resolved; lock files
    ["distributed"],  # rank variables, placement, the agent, the process group, communication
    ["model"],  # the Hugging Face model: found, its files read, its skeleton shaped, what a run does to it
    ["run_folder", "data"],  # the run folder's files; sources → tokens → packed sequences
    ["metrics"],  # a run's figures
    ["parallel", "lora", "rollouts"],  # strategies; LoRA's converter and adapter folder; sampling from the policy
    ["objectives"],  # what a step minimises: the LM loss, DPO, SimPO, KTO, a reward model's; the validation-loss loop
    ["finished"],  # a finished model: sampled, evaluated, scored (reward models), benchmarked via lm-eval, as GGUF
    ["plan", "rewards"],  # memory per rank and the time of a step, before any run; online RL's reward functions
    ["training"],  # a run: refused before any work, launched, decided, its ranks' loop
    ["k8s"],  # manifests sized by the plan the run's choices decide
    ["commands"],  # one module per subcommand: its parser and its body
    ["cli"],
    ["__main__"],
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """cputrain.run_folder.layout → run_folder; cputrain.training.trainer → training."""
    return module.split(".")[1]


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The cputrain modules `path` imports, anywhere in it (a package import counts as its __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("cputrain"):
            for alias in node.names:  # `from cputrain import model` imports the module cputrain.model
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cputrain"))
    return {m for m in found if m != "cputrain"}


def _graph() -> dict[str, set[str]]:
    files = {(_module_name(p)): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items() if name != "cputrain"}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _graph()}
    assert not units - set(LAYER_OF), f"place these in LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_import_runs_up_or_sideways():
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            a, b = _unit(module), _unit(target)
            if a != b and LAYER_OF.get(b, -1) >= LAYER_OF.get(a, -1):
                upward.append(f"{module} → {target}")
    assert not upward, "imports that run up (or sideways within a layer): " + "; ".join(sorted(upward))


def test_no_circle_of_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" → ".join(path[path.index(target):] + [target]))
            elif target in graph and target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(circles)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a low module that imports the trainer is reported."""
    fake = tmp_path / "cputrain"
    (fake / "run_folder").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "run_folder" / "__init__.py").write_text("")
    (fake / "training").mkdir()
    (fake / "training" / "__init__.py").write_text("")
    (fake / "run_folder" / "layout.py").write_text("def f():\n    from cputrain.training.trainer import Trainer\n")
    (fake / "training" / "trainer.py").write_text("from cputrain.run_folder.layout import f\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    try:
        test_no_import_runs_up_or_sideways()
    except AssertionError as exc:
        assert "cputrain.run_folder.layout → cputrain.training.trainer" in str(exc)
    else:
        raise AssertionError("an upward import went unseen")
    try:
        test_no_circle_of_modules()
    except AssertionError as exc:
        assert "cputrain.run_folder.layout" in str(exc) and "cputrain.training.trainer" in str(exc)
    else:
        raise AssertionError("a circle went unseen")
