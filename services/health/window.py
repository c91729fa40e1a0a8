"""Order statistics kept incrementally: a bounded window of floats with its exact median and MAD.

The window keeps its values in arrival order (to know which one leaves) and sorted (bisect insort and
delete: a memmove of at most `size` pointers). The median is then an index, and the MAD, the median
of |x - median|, is the k-th smallest of two sorted sequences (the distances left and right of the
median) found by binary search, so reading either costs O(log size) however large the window is.
"""

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence


class RobustWindow:
    __slots__ = ("_order", "_sorted", "size")

    def __init__(self, size: int) -> None:
        assert size >= 1, size
        self.size = size
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def clone(self) -> "RobustWindow":
        c = RobustWindow(self.size)
        c._order, c._sorted = self._order.copy(), list(self._sorted)
        return c

    def __len__(self) -> int:
        return len(self._order)

    def add(self, x: float) -> None:
        assert math.isfinite(x), x  # a NaN would break the sorted order for good
        if len(self._order) == self.size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(x)
        bisect.insort(self._sorted, x)

    def pop(self) -> float:
        """Take back the newest value."""
        x = self._order.pop()
        del self._sorted[bisect.bisect_left(self._sorted, x)]
        return x

    def median(self) -> float:
        return median_of_sorted(self._sorted)

    def mad(self) -> float:
        return mad_of_sorted(self._sorted, self.median())


def median_of_sorted(values: Sequence[float]) -> float:
    n = len(values)
    assert n, "the median of nothing"
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


def median_without(values: Sequence[float], index: int) -> float:
    """The median of sorted `values` with the one at `index` left out (the median of a rank's peers)."""
    m = len(values) - 1
    assert m >= 1 and 0 <= index <= m, (m, index)

    def at(k: int) -> float:
        return values[k] if k < index else values[k + 1]

    mid = m // 2
    return at(mid) if m % 2 else (at(mid - 1) + at(mid)) / 2


def _kth(a: Callable[[int], float], na: int, b: Callable[[int], float], nb: int, k: int) -> float:
    """The k-th smallest (from 0) of two ascending sequences given by accessors and lengths."""
    assert 0 <= k < na + nb, (k, na, nb)
    # Take i from a and k + 1 - i from b; the right i is the smallest with a(i) >= b(k - i).
    lo, hi = max(0, k + 1 - nb), min(k + 1, na)
    while lo < hi:
        i = (lo + hi) // 2
        if a(i) < b(k - i):
            lo = i + 1
        else:
            hi = i
    j = k + 1 - lo
    return max(a(lo - 1) if lo > 0 else -math.inf, b(j - 1) if j > 0 else -math.inf)


def mad_of_sorted(values: Sequence[float], median: float) -> float:
    """The median absolute deviation from `median` of sorted `values`, in O(log n)."""
    n = len(values)
    assert n, "the MAD of nothing"
    split = bisect.bisect_left(values, median)  # values[:split] lie below the median

    def left(i: int) -> float:
        return median - values[split - 1 - i]

    def right(j: int) -> float:
        return values[split + j] - median

    na, nb = split, n - split
    mid = n // 2
    if n % 2:
        return _kth(left, na, right, nb, mid)
    return (_kth(left, na, right, nb, mid - 1) + _kth(left, na, right, nb, mid)) / 2
