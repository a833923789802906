"""Instance types a cluster can be built from: a built-in table, or the user's own file.

The built-in rows are AWS's 7th-generation Intel families (Sapphire Rapids, all with AMX):
c7i at 2 GiB per vCPU, m7i at 4 and r7i at 8, each in 8xlarge (32 vCPUs), 16xlarge (64),
24xlarge (96) and 48xlarge (192), with AWS's published network bandwidth and the on-demand
Linux price in us-east-1 (list prices as of this table's writing: check them before budgeting).
A user table is a YAML or JSON list of {name, vcpus, memory_gib, amx} rows, optionally with
network_gbit_s and price_per_hour (`--instances-file`).

One TCP flow does not get a whole link on EC2: AWS publishes a limit of 5 Gbit/s per flow between
instances that are not in the same cluster placement group, and 10 Gbit/s within one ("Amazon EC2
instance network bandwidth", EC2 User Guide). The time plan caps each collective's flows so
(cputrain.plan.time.step_time), for every row of the table: the plan is of EC2 nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from cputrain.config.file import named_file_text
from cputrain.errors import ConfigError

GIB_PER_VCPU = {"c7i": 2, "m7i": 4, "r7i": 8}
SIZES_VCPUS = {"8xlarge": 32, "16xlarge": 64, "24xlarge": 96, "48xlarge": 192}
AMX_FAMILIES = {"c7i", "m7i", "r7i"}  # Sapphire Rapids: AMX-BF16 tiles
# AWS's "network bandwidth" per size, the same for the three families (8xlarge and up are fixed,
# not "up to" a burst rate).
NETWORK_GBIT_S = {"8xlarge": 12.5, "16xlarge": 25.0, "24xlarge": 37.5, "48xlarge": 50.0}
# On-demand Linux, us-east-1, USD per hour: list prices to check before budgeting.
PRICE_PER_HOUR = {
    "c7i": {"8xlarge": 1.428, "16xlarge": 2.856, "24xlarge": 4.284, "48xlarge": 8.568},
    "m7i": {"8xlarge": 1.6128, "16xlarge": 3.2256, "24xlarge": 4.8384, "48xlarge": 9.6768},
    "r7i": {"8xlarge": 2.1168, "16xlarge": 4.2336, "24xlarge": 6.3504, "48xlarge": 12.7008},
}
# AWS's single-flow limit between instances, Gbit/s: outside / inside a cluster placement group.
FLOW_GBIT_S = 5.0
FLOW_GBIT_S_IN_PLACEMENT_GROUP = 10.0
FIELDS = ("name", "vcpus", "memory_gib", "amx", "network_gbit_s", "price_per_hour")


@dataclass(frozen=True)
class Instance:
    name: str  # e.g. "m7i.16xlarge"
    vcpus: int
    memory_gib: float
    amx: bool
    network_gbit_s: float | None = None  # the node's link (None: not known; the time plan then asks for it)
    price_per_hour: float | None = None  # on-demand, USD (None: no cost per token is planned)

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def size(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else self.name

    @property
    def physical_cores(self) -> int:
        return max(1, self.vcpus // 2)  # two hyper-threads per core on these families


def flow_cap(placement_group: bool) -> tuple[float, str]:
    """(Gbit/s one TCP flow gets at most, and what that figure is) for nodes in a cluster placement
    group or not."""
    if placement_group:
        return FLOW_GBIT_S_IN_PLACEMENT_GROUP, "EC2's per-flow limit in a cluster placement group"
    return FLOW_GBIT_S, ("EC2's per-flow limit outside a cluster placement group; in one it is "
                         f"{FLOW_GBIT_S_IN_PLACEMENT_GROUP:g}: --placement-group")


def builtin_instances() -> list[Instance]:
    return [
        Instance(f"{family}.{size}", vcpus, vcpus * per_vcpu, family in AMX_FAMILIES, NETWORK_GBIT_S[size],
                 PRICE_PER_HOUR[family][size])
        for family, per_vcpu in GIB_PER_VCPU.items()
        for size, vcpus in SIZES_VCPUS.items()
    ]


def load_instances(path: str | None) -> list[Instance]:
    """The built-in table, or the rows of a user's YAML/JSON file."""
    if path is None:
        return builtin_instances()
    file = Path(path)
    text = named_file_text(file, f"--instances-file '{path}' not found; pass a YAML or JSON list of "
                           "{name, vcpus, memory_gib, amx} rows")
    try:
        rows = yaml.safe_load(text) if file.suffix != ".json" else json.loads(text)
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
        unknown = set(row) - set(FIELDS)
        if unknown:
            raise ConfigError(f"--instances-file '{path}' row {i + 1}: unknown field '{min(unknown)}' "
                              f"(fields: {', '.join(FIELDS)})")
        try:
            name, vcpus, mem = str(row["name"]), int(row["vcpus"]), float(row["memory_gib"])
        except KeyError as exc:
            raise ConfigError(f"--instances-file '{path}' row {i + 1} lacks '{exc.args[0]}'") from None
        except (TypeError, ValueError):
            raise ConfigError(f"--instances-file '{path}' row {i + 1}: vcpus must be an integer and memory_gib a number") from None
        if vcpus < 1 or mem <= 0:
            raise ConfigError(f"--instances-file '{path}' row {i + 1} ({name}): vcpus and memory_gib must be positive")
        optional = {}
        for key in ("network_gbit_s", "price_per_hour"):
            if row.get(key) is not None:
                try:
                    optional[key] = float(row[key])
                except (TypeError, ValueError):
                    raise ConfigError(f"--instances-file '{path}' row {i + 1} ({name}): {key} must be a number") from None
                if not optional[key] > 0:
                    raise ConfigError(f"--instances-file '{path}' row {i + 1} ({name}): {key} must be positive")
        out.append(Instance(name, vcpus, mem, bool(row.get("amx", False)), **optional))
    return out


def find_instance(instances: list[Instance], name: str) -> Instance:
    for inst in instances:
        if inst.name == name:
            return inst
    raise ConfigError(f"--instance-type '{name}' is not in the instance table; choose one of "
                      f"{', '.join(i.name for i in instances[:6])}{', …' if len(instances) > 6 else ''} "
                      "or pass --instances-file")
