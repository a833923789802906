"""Rendered objects as YAML: one multi-document stream, or one file per object in a folder.

Files are written next to nothing they would replace: an existing file with other content is
refused (pass --overwrite to replace it), so a hand-edited manifest is never lost.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cputrain.errors import UserError


class _Dumper(yaml.SafeDumper):
    """Safe YAML, with multi-line strings (the training config) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def to_stream(objects: list[dict]) -> str:
    return "---\n" + "---\n".join(to_yaml(o) for o in objects)


def file_name(index: int, obj: dict) -> str:
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_folder(objects: list[dict], folder: str | Path, overwrite: bool = False) -> list[Path]:
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output '{folder}' is a file; pass a folder for the manifests")
    planned = [(folder / file_name(i, o), to_yaml(o)) for i, o in enumerate(objects)]
    for path, text in planned:  # check all before writing any: no half-written folder
        if path.exists() and path.read_text() != text and not overwrite:
            raise UserError(f"--output: '{path}' exists with other content; choose another folder or pass --overwrite")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in planned:
        path.write_text(text)
    return [p for p, _ in planned]
