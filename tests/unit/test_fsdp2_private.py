"""FSDP2's private names, reached only through cputrain.parallel.fsdp2_private, are where that
module expects them: a torch upgrade that moves or renames one fails here, naming it, rather than
in a run (a layout's meshes multiplied, a prefetch issued synchronously, a reduce-scatter hook gone)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from cputrain.parallel.fsdp2_private import PRIVATE_NAMES

PACKAGE = Path(__file__).resolve().parents[2] / "cputrain"
SHIM = PACKAGE / "parallel" / "fsdp2_private.py"


@pytest.mark.parametrize(("module", "attribute"), PRIVATE_NAMES, ids=[f"{m}:{a}" for m, a in PRIVATE_NAMES])
def test_each_private_name_is_where_the_shim_reaches_it(module, attribute):
    import torch

    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"torch {torch.__version__} moved {module} ({exc}): cputrain.parallel.fsdp2_private needs "
                    f"{module}.{attribute}")
    for part in attribute.split("."):
        if not hasattr(found, part):
            pytest.fail(f"torch {torch.__version__} has no {module}.{attribute} (no {part}): it was renamed or "
                        "removed; update cputrain.parallel.fsdp2_private")
        found = getattr(found, part)


def _private_torch_uses(path: Path) -> list[str]:
    """Imports of torch modules or names that start with an underscore, and calls of FSDP2's private methods."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = node.module.split(".") + [a.name for a in node.names]
            if "fsdp" in node.module and any(n.startswith("_") for n in names) or any(
                    a.name.startswith("_") for a in node.names):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith(("_fsdp", "_set_unshard", "_get_post_forward")):
            found.append(node.attr)
    return found


def test_only_the_shim_reaches_fsdp2s_private_names():
    others = [p for p in PACKAGE.rglob("*.py") if p != SHIM]
    outside = {str(p.relative_to(PACKAGE)): uses for p in others if (uses := _private_torch_uses(p))}
    assert not outside, f"FSDP2's private names outside cputrain.parallel.fsdp2_private: {outside}"
    assert _private_torch_uses(SHIM), "the check above finds nothing: its patterns no longer match the shim"
