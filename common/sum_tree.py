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
        # More leaves than capacity, so prefix_one(capacity) is a valid query.
        self.size = 1 << self.depth
        self.tree = np.zeros(2 * self.size, dtype)
        # Scalar access to `tree`; write `tree` in place only (tree[:] = ...), so this view stays its alias.
        self.nodes = memoryview(self.tree)

    @property
    def total(self):
        return self.tree[1]

    def get(self, idx):
        return self.tree[np.asarray(idx, np.int64) + self.size]

    def add_one(self, i: int, delta) -> None:
        """Add `delta` to leaf i and its ancestors (integer trees: exact)."""
        nodes = self.nodes
        node = i + self.size
        while node:
            nodes[node] += delta
            node >>= 1

    def set_leaves(self, idx: list, values: list) -> None:
        """Set leaves idx (sorted, unique) to values and recompute their ancestors from their children. Each walk
        stops below its lowest common ancestor with the next leaf, which that leaf's walk recomputes (after this one):
        nearby leaves share most of their path to the root."""
        nodes = self.nodes
        size = self.size
        last = len(idx) - 1
        for j, (i, value) in enumerate(zip(idx, values)):
            node = i + size
            nodes[node] = value
            # Levels below the common ancestor with the next leaf (the root for the last leaf).
            if j < last:
                levels = (node ^ (idx[j + 1] + size)).bit_length() - 1
            else:
                levels = self.depth
            for _ in range(levels):
                # Parent = this node + its sibling (the same float as left + right).
                value += nodes[node ^ 1]
                node >>= 1
                nodes[node] = value

    def prefix_one(self, i: int):
        """Sum of leaves [0, i)."""
        nodes = self.nodes
        node = i + self.size
        total = 0
        while node > 1:
            if node & 1:
                total += nodes[node - 1]
            node >>= 1
        return total

    def find_one(self, v):
        """Leaf i with prefix_one(i) <= v < prefix_one(i + 1) (for counts: the (v+1)-th nonzero leaf)."""
        nodes = self.nodes
        node = 1
        for _ in range(self.depth):
            node <<= 1
            left = nodes[node]
            if v >= left:
                v -= left
                node += 1
        return node - self.size

    def count(self, a: int, b: int):
        """Sum of leaves [a, b) (a <= b), bottom-up: about 2 log2(b - a) nodes."""
        nodes = self.nodes
        lo = a + self.size
        hi = b + self.size
        total = 0
        while lo < hi:
            if lo & 1:
                total += nodes[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                total += nodes[hi]
            lo >>= 1
            hi >>= 1
        return total

    def last_nonzero_at_or_before(self, i: int) -> int:
        """Count trees: the largest leaf j <= i that is nonzero; circularly, the largest nonzero leaf when none is
        (the tree must not be empty). Climbs until a left sibling holds a nonzero leaf, then descends into it."""
        nodes = self.nodes
        node = i + self.size
        if nodes[node]:
            return i
        while node > 1:
            if node & 1 and nodes[node - 1]:
                node -= 1
                break
            node >>= 1
        # The rightmost nonzero leaf under node (under the root after a wrap).
        while node < self.size:
            node = 2 * node + 1 if nodes[2 * node + 1] else 2 * node
        return node - self.size

    def nth_after(self, i: int, m: int) -> int:
        """0/1 count trees: the m-th nonzero leaf after leaf i, circularly (1 <= m < total). Climbs until the
        right siblings passed hold m, then descends; the same as find_one((prefix_one(i + 1) + m - 1) mod total)."""
        nodes = self.nodes
        node = i + self.size
        while node > 1:
            # A left child: its right sibling comes next.
            if not node & 1:
                right = nodes[node + 1]
                if m <= right:
                    node += 1
                    break
                m -= right
            node >>= 1
        # The m-th nonzero leaf under node (from leaf 0 after a wrap).
        while node < self.size:
            node <<= 1
            left = nodes[node]
            if m > left:
                m -= left
                node += 1
        return node - self.size
