"""Input checks for rendered manifests: every refusal names the flag or field at fault.

The rules are Kubernetes' own: object names are DNS-1123 labels (RFC 1123: lower-case
alphanumerics and '-', starting and ending alphanumeric, at most 63 characters); resource
quantities follow apimachinery's `resource.Quantity` grammar (a decimal number, optionally an
exponent, optionally a binary suffix Ki…Ei or a decimal one n, u, m, k, M, G, T, P, E).
"""

from __future__ import annotations

import re
from decimal import Decimal

from cputrain.errors import UserError


class ManifestError(UserError):
    """A cluster option that would render a manifest Kubernetes refuses."""


DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^(?P<num>[+]?(\d+(\.\d*)?|\.\d+))(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
           "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)}


def check_name(value: str | None, field: str, max_len: int = 63) -> str:
    if not value:
        raise ManifestError(f"{field} is required: a lower-case name such as 'llama-ft'")
    if len(value) > max_len or not DNS1123_LABEL.match(value):
        raise ManifestError(
            f"{field} '{value}' is not a valid Kubernetes name (DNS-1123 label): use at most {max_len} lower-case "
            "letters, digits and '-', starting and ending with a letter or digit"
        )
    return value


# EC2's placement group names: up to 255 ASCII characters (CreatePlacementGroup's GroupName); no
# spaces here, so that the name reads the same in a shell and in the manifest.
PLACEMENT_GROUP_NAME = re.compile(r"^[\x21-\x7e]{1,255}$")


def check_placement_group(value: str, field: str) -> str:
    if not PLACEMENT_GROUP_NAME.match(value):
        raise ManifestError(f"{field} '{value}' is not an EC2 placement group name: 1 to 255 ASCII characters "
                            "without spaces, as `aws ec2 create-placement-group --group-name` took it")
    return value


def quantity_value(value: str, field: str) -> Decimal:
    """The number a quantity stands for (bytes for memory, cores for CPU)."""
    m = QUANTITY.match(str(value).strip())
    if not m:
        raise ManifestError(
            f"{field} '{value}' is not a Kubernetes quantity: write a number with an optional suffix, "
            "e.g. 64Gi, 500Mi, 16 or 15500m"
        )
    num, suffix = Decimal(m["num"]), m["suffix"] or ""
    if suffix in BINARY:
        return num * BINARY[suffix]
    if suffix[:1] in "eE" and suffix:
        return num * Decimal(10) ** int(suffix[1:])
    return num * DECIMAL[suffix]


def check_quantity(value: str | int, field: str) -> str:
    if quantity_value(str(value), field) <= 0:
        raise ManifestError(f"{field} '{value}' must be more than zero")
    return str(value)


def check_count(value: int | None, field: str) -> int:
    if value is None or int(value) < 1:
        raise ManifestError(f"{field} must be at least 1 (got {value})")
    return int(value)


def check_image(value: str | None) -> str:
    if not value or not value.strip():
        raise ManifestError("--image is required: the training image every pod runs, e.g. "
                            "registry.example.com/cputrain:0.1.0 (build it from the Dockerfile)")
    if any(c.isspace() for c in value) or value != value.strip():
        raise ManifestError(f"--image '{value}' is not an image reference: it contains whitespace")
    return value


def check_env_name(value: str, field: str) -> str:
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", value):
        raise ManifestError(f"{field}: '{value}' is not an environment variable name")
    return value
