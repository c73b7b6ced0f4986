"""A sum tree (segment tree of sums) walked node by node in plain Python, for a few keys per operation.

Leaves sit at [size, 2 size) of one numpy array, each inner node holds the sum of its two children. The methods walk
the tree through `nodes`, a memoryview of that array: Python ints and floats cost far less per node than numpy
scalars or numpy calls. Every walk touches at most 2 log2(size) nodes; the local queries (`count`, `nth_after`,
`last_nonzero_at_or_before`) climb only as high as the distance they span. Integer trees take exact deltas
(`add_one`); `set_leaves` recomputes parents from their children, so float sums never drift and the same leaves
always give the same tree. Used by reactor.py's lazy priorities (paper 3.3).
"""

import numpy as np


class SumTree:
    def __init__(self, capacity: int, dtype):
        self.depth = max(1, int(np.ceil(np.log2(capacity + 1))))
        self.size = 1 << self.depth  # > capacity, so prefix_one(capacity) is a valid query
        self.tree = np.zeros(2 * self.size, dtype)
        self.nodes = memoryview(self.tree)  # scalar access; write `tree` in place only (tree[:] = ...)

    @property
    def total(self):
        return self.tree[1]

    def get(self, idx):
        return self.tree[np.asarray(idx, np.int64) + self.size]

    def add_one(self, i: int, delta) -> None:
        """Add `delta` to leaf i and its ancestors (integer trees: exact)."""
        t, nd = self.nodes, i + self.size
        while nd:
            t[nd] += delta
            nd >>= 1

    def set_leaves(self, idx: list, values: list) -> None:
        """Set leaves idx (sorted, unique) to values and recompute their ancestors from their children. Each walk
        stops below its lowest common ancestor with the next leaf, which that leaf's walk recomputes (after this one):
        nearby leaves share most of their path to the root."""
        t, size, last = self.nodes, self.size, len(idx) - 1
        for j, (i, v) in enumerate(zip(idx, values)):
            nd = i + size
            t[nd] = v
            # levels below the common ancestor with the next leaf (the root for the last leaf)
            levels = ((nd ^ (idx[j + 1] + size)).bit_length() - 1) if j < last else self.depth
            for _ in range(levels):
                v += t[nd ^ 1]  # parent = this node + its sibling (the same float as left + right)
                nd >>= 1
                t[nd] = v

    def prefix_one(self, i: int):
        """Sum of leaves [0, i)."""
        t, nd, res = self.nodes, i + self.size, 0
        while nd > 1:
            if nd & 1:
                res += t[nd - 1]
            nd >>= 1
        return res

    def find_one(self, v):
        """Leaf i with prefix_one(i) <= v < prefix_one(i + 1) (for counts: the (v+1)-th nonzero leaf)."""
        t, nd = self.nodes, 1
        for _ in range(self.depth):
            nd <<= 1
            left = t[nd]
            if v >= left:
                v -= left
                nd += 1
        return nd - self.size

    def count(self, a: int, b: int):
        """Sum of leaves [a, b) (a <= b), bottom-up: about 2 log2(b - a) nodes."""
        t, lo, hi, res = self.nodes, a + self.size, b + self.size, 0
        while lo < hi:
            if lo & 1:
                res += t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                res += t[hi]
            lo >>= 1
            hi >>= 1
        return res

    def last_nonzero_at_or_before(self, i: int) -> int:
        """Count trees: the largest leaf j <= i that is nonzero; circularly, the largest nonzero leaf when none is
        (the tree must not be empty). Climbs until a left sibling holds a nonzero leaf, then descends into it."""
        t, nd = self.nodes, i + self.size
        if t[nd]:
            return i
        while nd > 1:
            if nd & 1 and t[nd - 1]:
                nd -= 1
                break
            nd >>= 1
        while nd < self.size:  # the rightmost nonzero leaf under nd (the whole tree after a wrap)
            nd = 2 * nd + 1 if t[2 * nd + 1] else 2 * nd
        return nd - self.size

    def nth_after(self, i: int, m: int) -> int:
        """0/1 count trees: the m-th nonzero leaf after leaf i, circularly (1 <= m < total). Climbs until the
        right siblings passed hold m, then descends; the same as find_one((prefix_one(i + 1) + m - 1) mod total)."""
        t, nd = self.nodes, i + self.size
        while nd > 1:
            if not nd & 1:  # a left child: its right sibling comes next
                right = t[nd + 1]
                if m <= right:
                    nd += 1
                    break
                m -= right
            nd >>= 1
        while nd < self.size:  # the m-th nonzero leaf under nd (from leaf 0 after a wrap)
            nd <<= 1
            left = t[nd]
            if m > left:
                m -= left
                nd += 1
        return nd - self.size
