"""Paged KV-cache bookkeeping: which blocks of the pool each request holds, and the prefix cache.

Plain Python (no torch): the tensors live in the model runner; this module only hands out
block ids. A block holds `block_size` consecutive tokens of one sequence.

Prefix caching: once a block is full, it gets a hash chained over all the token ids before it
(hash(parent_hash, block_tokens)), so equal hashes mean equal prefixes. A freed block keeps its
hash and stays reusable until it is evicted; free blocks are evicted least recently freed
first, and a request frees its blocks tail first so a shared prefix outlives its suffixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = int


def chain_root(salt: str | None) -> BlockHash | None:
    """The parent of a sequence's first block: None for the base model, else one per salt."""
    return None if salt is None else hash(("salt", salt))


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Chained hash of a full block: its tokens and everything before them (via the parent)."""
    return hash((parent, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0  # requests using the block; 0 means it sits in the free queue
    block_hash: BlockHash | None = None  # set once the block is full and its KV written


@dataclass
class BlockTable:
    """The blocks one request holds, in sequence order, and the hashes of its full blocks."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # one per cached full block


class BlockManager:
    """Hands out KV blocks; every method is O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front is evicted first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # hash -> block id holding that prefix
        self._tables: dict[str, BlockTable] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables[request_id].block_ids

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def find_cached_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """Block ids holding the longest cached prefix of `token_ids`, in full blocks. At least
        the last token is left out, because its logits must be computed. `salt` (a LoRA
        adapter's name) roots the hash chain: the same tokens under another adapter (or the
        base model) have other KV and never match."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        parent = chain_root(salt)
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, num_tokens: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Whether a new request of `num_tokens` (reusing `cached_block_ids`) fits now."""
        reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        new = self.blocks_needed(num_tokens) - len(cached_block_ids)
        return new <= self.num_free_blocks - reclaimed

    def allocate(
        self, request_id: str, num_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> None:
        """Give a new request the cached blocks plus fresh ones, enough for `num_tokens`."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if not self.can_allocate(num_tokens, cached_block_ids):
            raise ValueError(f"not enough free blocks for {num_tokens} tokens")
        table = BlockTable()
        for block_id in cached_block_ids:
            self._touch(block_id)
            table.block_ids.append(block_id)
            table.block_hashes.append(self.blocks[block_id].block_hash)
        self._tables[request_id] = table
        self._grow(table, num_tokens)

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Whether a running request can grow to `num_tokens` tokens in total."""
        table = self._tables[request_id]
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.num_free_blocks

    def append(self, request_id: str, num_tokens: int) -> None:
        """Grow a running request's table to cover `num_tokens` tokens in total."""
        if not self.can_append(request_id, num_tokens):
            raise ValueError(f"not enough free blocks to grow {request_id!r} to {num_tokens}")
        self._grow(self._tables[request_id], num_tokens)

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: str | None = None
    ):
        """Register the hashes of blocks that became full now that `num_computed` tokens of
        `token_ids` have their KV written; later requests with the same prefix (and `salt`)
        reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = min(num_computed // self.block_size, len(table.block_ids))
        parent = table.block_hashes[-1] if table.block_hashes else chain_root(salt)
        for i in range(len(table.block_hashes), num_full):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            table.block_hashes.append(parent)
            block = self.blocks[table.block_ids[i]]
            if parent not in self._cached:  # a duplicate (computed twice at once) stays private
                block.block_hash = parent
                self._cached[parent] = block.block_id

    def can_fork(self, num_tokens: int) -> bool:
        """Whether a fork of `num_tokens` computed tokens fits now (see fork)."""
        return num_tokens % self.block_size == 0 or self.num_free_blocks >= 1

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Give `child_id` the KV of the first `num_tokens` tokens of `parent_id`. Full blocks
        are shared (their KV never changes again, so both tables point at them). A partly
        filled last block is not: both requests will write their next tokens into it, so the
        child gets a fresh block, returned as (source, copy) for the runner to copy the KV.
        Ref counts make freeing either request safe in any order."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already holds blocks")
        parent = self._tables[parent_id]
        num_full = num_tokens // self.block_size
        if len(parent.block_ids) < self.blocks_needed(num_tokens):
            raise ValueError(f"{parent_id!r} holds fewer blocks than {num_tokens} tokens need")
        if not self.can_fork(num_tokens):
            raise ValueError(f"no free block to fork {parent_id!r}")
        table = BlockTable(block_hashes=list(parent.block_hashes[:num_full]))
        for block_id in parent.block_ids[:num_full]:
            self._touch(block_id)
            table.block_ids.append(block_id)
        self._tables[child_id] = table
        if num_tokens % self.block_size == 0:
            return None
        self._grow(table, num_tokens)
        return parent.block_ids[num_full], table.block_ids[-1]

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink a request's table to the blocks `num_tokens` tokens need: the tail blocks
        held only rejected speculative positions. Such blocks were allocated fresh for this
        request and never hashed (hashes cover computed tokens only), so they go back to the
        front of the free queue, first to be reused."""
        table = self._tables[request_id]
        keep = self.blocks_needed(num_tokens)
        if keep < len(table.block_hashes):
            raise ValueError(
                f"cannot truncate {request_id!r} to {num_tokens} tokens: its first "
                f"{len(table.block_hashes)} blocks are cached prefix"
            )
        while len(table.block_ids) > keep:
            block = self.blocks[table.block_ids.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                self._free.move_to_end(block.block_id, last=False)

    def free(self, request_id: str) -> None:
        """Release a request's blocks (tail first). Hashed blocks stay reusable until evicted."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    # Nothing to reuse in it: evict before blocks that hold a cached prefix.
                    self._free.move_to_end(block_id, last=False)

    # ---- internals -----------------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _grow(self, table: BlockTable, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(num_tokens) - len(table.block_ids)):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the cached prefix it held
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            table.block_ids.append(block_id)
