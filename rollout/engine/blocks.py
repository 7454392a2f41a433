"""Block bookkeeping of the paged KV cache: free list, reference counts, reservations, and the prefix cache.

The cache is cut into blocks of `block_size` token rows. A request owns a list of blocks (its block table).
Prefix reuse is by hash of full blocks (vLLM's scheme): a full block is registered under the digest of
every token from the sequence start to its end, so two sequences share a block exactly when their first
(i + 1) * block_size tokens are equal. Shared blocks are read-only: a block is registered only once all its
rows are decided, and nobody writes a row twice, so no copy-on-write is ever needed.
A registered block nobody uses stays cached (idle, LRU) until its space is needed.

Memory budget: admission reserves every block a request can ever need (prompt + max_new_tokens - 1 rows),
so allocation during decode never fails and nothing is ever preempted for lack of memory.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


def block_digests(tokens: list[int], block_size: int, num_blocks: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Digests of full blocks start..num_blocks-1 of `tokens`, chained from `parent` (the digest of block start-1)."""
    out = []
    for i in range(start, num_blocks):
        chunk = np.asarray(tokens[i * block_size : (i + 1) * block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class BlockManager:
    """Allocates cache blocks under a fixed budget; shares full blocks between sequences with equal prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.digest: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # digest -> block holding those rows
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered blocks with refcount 0, oldest first
        self.reserved = 0  # blocks promised to admitted requests, not yet allocated

    @property
    def available(self) -> int:
        """Blocks a new request may still claim."""
        return len(self.free) + len(self.idle) - self.reserved

    def match(self, digests: list[bytes]) -> list[int]:
        """The cached blocks holding the longest prefix of `digests`."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for d in digests:
            block = self.cached.get(d)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cost_of(self, blocks: list[int]) -> int:
        """Blocks that acquiring `blocks` takes out of `available` (idle ones stop being evictable)."""
        return sum(1 for b in blocks if self.refcount[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refcount[b] == 0:
                self.idle.pop(b, None)
            self.refcount[b] += 1

    def reserve(self, n: int) -> None:
        if n > self.available:
            raise RuntimeError(f"cannot reserve {n} blocks, {self.available} available")  # a scheduler bug
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def allocate(self) -> int:
        """One block out of a reservation: a free one, else the least recently used idle cached one."""
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.idle.popitem(last=False)
            self._forget(block)
        self.reserved -= 1
        self.refcount[block] = 1
        return block

    def register(self, block: int, digest: bytes) -> bool:
        """Make a full block findable by its digest; False when another block already holds those rows."""
        if not self.enable_prefix_caching or digest in self.cached:
            return False
        self.cached[digest] = block
        self.digest[block] = digest
        return True

    def forget(self, block: int) -> None:
        """Drop a block's registration (its rows are not trustworthy, e.g. its forward failed)."""
        self._forget(block)
        if self.refcount[block] == 0 and block in self.idle:
            del self.idle[block]
            self.free.append(block)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.digest[b] is not None:
                    self.idle[b] = None
                else:
                    self.free.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every registration: idle blocks become free, blocks in use stay with their owners."""
        for block in list(self.cached.values()):
            self._forget(block)
        self.free.extend(self.idle)
        self.idle.clear()

    def _forget(self, block: int) -> None:
        digest = self.digest[block]
        if digest is not None:
            self.digest[block] = None
            if self.cached.get(digest) == block:
                del self.cached[digest]

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)
