"""The statistics every benchmark reports: percentiles (median, p99) and ratios to a peer's figure."""
from __future__ import annotations

import math
from typing import Optional, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, nearest-rank."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def ratio(ours: float, theirs: Optional[float]) -> Optional[float]:
    """``ours / theirs``, or None when there is no usable figure to compare with.

    perftest prints "inf" when its cycle counter misbehaves (seen under a
    loaded TCG guest), and 0 or nothing when it failed: no ratio then.
    """
    return ours / theirs if theirs and math.isfinite(theirs) else None
