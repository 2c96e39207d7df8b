"""The statistics every benchmark reports: percentiles (median, p99) and ratios to a peer's figure."""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence


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


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the finite values (mean of the middle two for an even count); None when there are none.

    Used for the median of per-round figures and ratios (``--repeat``); a
    round that could not measure a figure contributes None and is left out.
    """
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if not finite:
        return None
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2
