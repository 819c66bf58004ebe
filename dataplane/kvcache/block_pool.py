"""The physical KV block pool: block ids, ref counts and the free list. Imports no torch.

Every block is in exactly one state: free (ref_cnt == 0, in the free queue) or
referenced (ref_cnt >= 1, owned by one or more block tables). The prefix-caching
work adds a third state, cached-unreferenced, which also lives in the free queue
(it is evictable), so the free queue is an LRU order as well as a free list.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class Block:
    """One physical block. The links make the free queue intrusive: O(1) removal from its middle."""

    __slots__ = ("block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front, append at the back, remove anywhere.

    A Python deque cannot remove from its middle in O(1); prefix-cache hits need exactly
    that (a cached free block gets referenced again), so the links live in the blocks.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def append(self, block: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns `num_blocks` blocks. Allocation returns None when the request does not fit."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block] | None:
        """Take `n` free blocks (ref_cnt becomes 1), or change nothing and return None."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_queue):
            return None
        taken = [self.free_queue.popleft() for _ in range(n)]
        for block in taken:
            block.ref_cnt = 1
        return taken

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (already referenced) block: sharing without copying."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"incref on unreferenced {block}")
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + referenced == total and the free queue is consistent."""
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == len(self.free_queue), "free queue length out of sync"
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        for block_id in free_ids:
            assert self.blocks[block_id].ref_cnt == 0, f"{self.blocks[block_id]} is free but referenced"
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert referenced + len(free_ids) == self.num_blocks, (
            f"free ({len(free_ids)}) + referenced ({referenced}) != total ({self.num_blocks})"
        )
