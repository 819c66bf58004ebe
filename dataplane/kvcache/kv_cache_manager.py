"""Maps requests' logical blocks onto the pool's physical blocks. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataplane.kvcache.block_pool import BlockPool

if TYPE_CHECKING:
    # Annotation only: a runtime import makes `import dataplane.kvcache` circular via dataplane.scheduler.
    from dataplane.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Grows and releases the block tables that requests own.

    Allocation is query-then-commit: `allocate_slots` either appends every block the
    request needs to its table or changes nothing and returns None.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`.

        Returns the newly appended block ids (possibly empty), or None, changing nothing,
        when the pool has too few free blocks.
        """
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed <= 0:
            return []
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return None
        new_ids = [b.block_id for b in blocks]
        request.block_table.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Release every block of `request`; its block table becomes empty.

        Freed in reverse so that, once prefix caching keeps freed blocks, the tail of a
        chain is evicted before its head.
        """
        self.pool.free(reversed(request.block_table))
        request.block_table = []

    def check_integrity(self) -> None:
        self.pool.check_integrity()
