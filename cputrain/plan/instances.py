"""Instance types a cluster can be built from: a built-in table, or the user's own file.

The built-in rows are AWS's 7th-generation Intel families (Sapphire Rapids, all with AMX):
c7i at 2 GiB per vCPU, m7i at 4 and r7i at 8, each in 8xlarge (32 vCPUs), 16xlarge (64),
24xlarge (96) and 48xlarge (192). A user table is a YAML or JSON list of
{name, vcpus, memory_gib, amx} rows (`--instances-file`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from cputrain.errors import ConfigError

GIB_PER_VCPU = {"c7i": 2, "m7i": 4, "r7i": 8}
SIZES_VCPUS = {"8xlarge": 32, "16xlarge": 64, "24xlarge": 96, "48xlarge": 192}
AMX_FAMILIES = {"c7i", "m7i", "r7i"}  # Sapphire Rapids: AMX-BF16 tiles


@dataclass(frozen=True)
class Instance:
    name: str  # e.g. "m7i.16xlarge"
    vcpus: int
    memory_gib: float
    amx: bool

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def size(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else self.name

    @property
    def physical_cores(self) -> int:
        return max(1, self.vcpus // 2)  # two hyper-threads per core on these families


def builtin_instances() -> list[Instance]:
    return [
        Instance(f"{family}.{size}", vcpus, vcpus * per_vcpu, family in AMX_FAMILIES)
        for family, per_vcpu in GIB_PER_VCPU.items()
        for size, vcpus in SIZES_VCPUS.items()
    ]


def load_instances(path: str | None) -> list[Instance]:
    """The built-in table, or the rows of a user's YAML/JSON file."""
    if path is None:
        return builtin_instances()
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--instances-file '{path}' not found; pass a YAML or JSON list of "
                          "{name, vcpus, memory_gib, amx} rows")
    try:
        rows = yaml.safe_load(file.read_text()) if file.suffix != ".json" else json.loads(file.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--instances-file '{path}' is not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
    if isinstance(rows, dict) and "instances" in rows:
        rows = rows["instances"]
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"--instances-file '{path}' must hold a non-empty list of {{name, vcpus, memory_gib, amx}} rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"--instances-file '{path}' row {i + 1} is not a mapping; write name:, vcpus:, memory_gib:")
        unknown = set(row) - {"name", "vcpus", "memory_gib", "amx"}
        if unknown:
            raise ConfigError(f"--instances-file '{path}' row {i + 1}: unknown field '{sorted(unknown)[0]}' "
                              "(fields: name, vcpus, memory_gib, amx)")
        try:
            name, vcpus, mem = str(row["name"]), int(row["vcpus"]), float(row["memory_gib"])
        except KeyError as exc:
            raise ConfigError(f"--instances-file '{path}' row {i + 1} lacks '{exc.args[0]}'") from None
        except (TypeError, ValueError):
            raise ConfigError(f"--instances-file '{path}' row {i + 1}: vcpus must be an integer and memory_gib a number") from None
        if vcpus < 1 or mem <= 0:
            raise ConfigError(f"--instances-file '{path}' row {i + 1} ({name}): vcpus and memory_gib must be positive")
        out.append(Instance(name, vcpus, mem, bool(row.get("amx", False))))
    return out


def find_instance(instances: list[Instance], name: str) -> Instance:
    for inst in instances:
        if inst.name == name:
            return inst
    raise ConfigError(f"--instance-type '{name}' is not in the instance table; choose one of "
                      f"{', '.join(i.name for i in instances[:6])}{', …' if len(instances) > 6 else ''} "
                      "or pass --instances-file")
