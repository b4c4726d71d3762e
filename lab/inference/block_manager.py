"""Paged KV bookkeeping: which physical cache blocks each sequence owns, and which blocks can be shared.

PagedAttention's idea (Kwon et al., SOSP 2023, the vLLM paper) is virtual memory for the KV cache: the cache is
one pool of `num_blocks` fixed-size blocks of `block_size` token slots each, and a sequence's K/V live in
whatever blocks it was given, listed in order in its *block table*. Position p of a sequence lives in slot

    block_table[p // block_size] * block_size + p % block_size

of the pool (`slot_mapping`). A sequence wastes at most the unused tail of its last block, instead of a whole
`max_len` reservation, and blocks can be *shared*: two requests with the same first 512 tokens can point at the
same blocks, since K/V at a position depend only on the tokens up to it.

This module holds no tensors: it is the allocator the model runner trusts. The pieces:

- Reference counts. A block is used by `ref_count` sequences; only at 0 may its slots be given to someone else.
- Prefix caching (vLLM's "automatic prefix caching", nano-vllm's block manager). A FULL block's identity is
  hash((parent_hash, its tokens)): a hash chain, so equal hashes mean equal tokens *and* equal prefix, which is
  what equal K/V require. A map hash -> block id finds blocks a new prompt can reuse. Only full blocks are
  hashed: a partial block is still being written to by its sequence, and sharing it would let one sequence's
  next token overwrite another's.
- Eviction. A cached block whose ref count falls to 0 keeps its K/V and stays findable by its hash, on an
  *evictable* list ordered by when it was freed. Fresh blocks are handed out first; when none is left the least
  recently freed cached block is evicted (its hash forgotten) and reused. A cache hit on an evictable block takes
  it back off that list: it is in use again.

What the sequence sees: `allocate` on admission (reuse the cached prefix, reserve the rest), `ensure_slots`
before each step (one more block when a decode crosses a block boundary), `commit` after each step (publish the
newly full blocks), `free` when it finishes or is preempted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from lab.inference.sequence import Sequence

# The parent hash of a sequence's first block. Any fixed integer will do (hash(None) would change between runs
# on Python < 3.12, which only matters for reproducible printouts, not for correctness).
ROOT_HASH = 0


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The chained hash of one full block. Python's hash of a tuple of ints is 64-bit and the same in every run;
    a collision would need two different prefixes with the same 64-bit value, and the token check in
    `_cached_prefix` catches the simple case of two different blocks after the same prefix. (vLLM offers
    SHA-256 when tenants must not be able to craft collisions.)"""
    return hash((parent_hash, tokens))


@dataclass
class Block:
    """One physical block. `hash` is set once the block is full and committed (None otherwise); `tokens` are
    kept to check a hash hit against the real token ids."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


class BlockManager:
    """The block pool of a paged KV cache, with reference counts, prefix caching and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # ref count 0, no hash: handed out first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, cached; oldest-freed first
        self.cached: dict[int, int] = {}  # hash -> block id, for every block a new prompt may reuse
        self.prefix_hits = 0  # tokens whose K/V came from the cache
        self.prefix_queries = 0  # tokens that were looked up (every admitted sequence's tokens)

    # -- the pool ---------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be given out now: fresh ones plus cached ones nobody uses (evicting them)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """The fraction of blocks referenced by at least one sequence."""
        return 1 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` token slots (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    def _take_free_block(self) -> int:
        """A block with ref count 1 for a new owner: a fresh block if any, else evict the least recently freed
        cached block (forgetting its hash, since its slots are about to be overwritten)."""
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.tokens = None, ()
        block.ref_count = 1
        return block.block_id

    # -- prefix caching ---------------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The block ids of the longest run of the sequence's leading full blocks found in the cache.

        At most (num_tokens - 1) // block_size blocks are looked at, never the block holding the last token: the
        last token must go through the model because its logits give the next token. When the prompt length is a
        multiple of the block size and every block is cached, the last block is therefore recomputed (into a
        block of the sequence's own) rather than the whole prompt skipped, which would leave nothing to run
        (nano-vllm issue #144; vLLM caps the hit length at num_tokens - 1 the same way)."""
        if not self.enable_prefix_caching:
            return []
        hit_ids: list[int] = []
        parent = ROOT_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = block_hash(parent, tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hit_ids.append(block_id)
        return hit_ids

    def num_cached_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of a waiting sequence `allocate` would find in the cache now (no change)."""
        return len(self._cached_prefix(seq)) * self.block_size

    def allocate(self, seq: Sequence) -> bool:
        """Admit a sequence that holds no blocks (new, or preempted): reuse the cached blocks of its prefix
        (ref count + 1), reserve fresh blocks for the rest of its tokens, and set `num_computed_tokens` to the
        cached length. Reserving the whole rest now means a prefill, once admitted, never waits for memory halfway
        (only decodes grow, one block at a time). False, with nothing changed, when the blocks are not there."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}; free it first")
        hit_ids = self._cached_prefix(seq)
        num_new = self.blocks_needed(seq.num_tokens) - len(hit_ids)
        # A hit on an evictable block takes it out of the pool of blocks we could give out.
        available = self.num_free_blocks - sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        if num_new > available:
            return False
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = hit_ids + [self._take_free_block() for _ in range(num_new)]
        seq.num_computed_tokens = len(hit_ids) * self.block_size
        seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.prefix_hits += seq.num_computed_tokens
        self.prefix_queries += seq.num_tokens
        return True

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_computed_tokens + num_new_tokens` tokens. False, with nothing
        changed, when there are not enough blocks (the scheduler then preempts someone)."""
        num_new = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if num_new > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(num_new))
        return True

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The cache slot of each position in [start, end): where the model runner writes (and reads) its K/V."""
        if not 0 <= start <= end <= len(seq.block_table) * self.block_size:
            raise ValueError(
                f"positions [{start}, {end}) must lie in [0, {len(seq.block_table) * self.block_size}], "
                f"the slots of sequence {seq.seq_id}'s {len(seq.block_table)} blocks"
            )
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def commit(self, seq: Sequence) -> None:
        """After a step, hash the sequence's blocks that are now full of computed K/V and publish them.

        Hashing happens here, after the model has written the K/V, not at allocation: a block is findable only
        once its contents exist. If the hash is already cached in another block (two sequences computed the same
        prefix in the same steps, or the recomputed last block of a full hit), both blocks stay valid for their
        own sequences; the map keeps the first, and the duplicate carries the hash only so that the chain can go
        on from it, and returns to the fresh list when freed. Block tables never change under a running sequence.
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = 0  # blocks are hashed in order, so the hashed ones are a prefix of the table
        while start < num_full and self.blocks[seq.block_table[start]].hash is not None:
            start += 1
        parent = self.blocks[seq.block_table[start - 1]].hash if start > 0 else ROOT_HASH
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            block.tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block.hash = parent = block_hash(parent, block.tokens)
            self.cached.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks: ref count - 1 each; a block nobody uses any more becomes evictable if it
        is the cached copy of its hash, or fresh otherwise. Blocks are released last-first, so the tail of a
        sequence (least likely to be shared) is evicted before its head (vLLM does the same)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue  # still used by another sequence
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                self.evictable[block_id] = None
            else:
                block.hash, block.tokens = None, ()
                self.free_ids.append(block_id)
        seq.block_table = []
