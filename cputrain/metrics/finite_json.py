"""JSON that strict readers accept: a non-finite float (a diverged loss, no validation data) is null.

json.dumps writes NaN and Infinity by default, which are not JSON: jq, JavaScript's JSON.parse
and most readers outside Python refuse a whole metrics file over one such value.
"""

from __future__ import annotations

import json
import math


def finite(value):
    """`value` with every NaN or infinity, at any depth, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps that cannot write NaN: non-finite floats become null first, and allow_nan=False
    turns any left (a numpy array's, say) into an error instead of an invalid file."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
