"""Which records are held out for validation: whole records, chosen by a seeded permutation.

stats.json states the rule and the counts, not a list, so a 10M-record corpus costs 8 bytes per
record while the choice is made and nothing after.
"""

from __future__ import annotations

import numpy as np

VALIDATION_RULE = ("record i of the first `records` records is held out (whole) when i is among the first "
                   "`val_records` entries of numpy.random.default_rng(seed).permutation(records); "
                   "val_records = round(records × val_fraction), at least 1 when val_fraction > 0")


def validation_mask(records: int, val_fraction: float, seed: int) -> tuple[np.ndarray, int]:
    """Which records are validation documents: a seeded choice of whole records, as VALIDATION_RULE says."""
    n_val = int(round(records * val_fraction))
    if val_fraction > 0 and records > 1:
        n_val = max(1, n_val)
    mask = np.zeros(records, dtype=bool)
    mask[np.random.default_rng(seed).permutation(records)[:n_val]] = True
    return mask, n_val
