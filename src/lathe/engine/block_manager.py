"""A paged KV block allocator with reference counts and prefix sharing (vLLM / nano-vllm's block manager).

Blocks hold `block_size` tokens' K/V. A full block is keyed by a hash chained over all tokens up to its
end (and, for an image prompt, over its images' digest), so any sequence whose prefix matches reuses it (the `n` samples of a prompt, or two prompts with a
common system prompt). With `share_partial=True` the last, partial block of a prompt is keyed too, so the
`n` samples share it as well; the first sample to append to a shared partial block gets a private copy
(copy-on-write): `may_append` returns the `(src, dst)` block pairs the KV cache must copy before the step.

A block whose sequences all finished keeps its content and key, and is revived by a later hit until it
is handed out again. `reset()` forgets every key: it must run on every weight update, so that KV
computed by old weights never serves a new prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lathe.engine.sequence import PENDING, Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None            # key in `hash_to_block`, None when unregistered
    token_ids: list[int] = field(default_factory=list)


def block_hash(prefix_hash: int | None, token_ids: list[int], partial: bool) -> int:
    """Chained key of a block: the previous block's key, this block's tokens, and whether it is partial."""
    return hash((prefix_hash, tuple(token_ids), partial))


def _salt(seq: Sequence) -> int | None:
    """What a sequence's first block key starts from: its images' digest for an image prompt (the same tokens with
    other images must not share KV), else nothing."""
    return None if seq.mm is None else seq.mm.salt


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 share_partial: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager: num_blocks={num_blocks}, block_size={block_size}; both must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_partial = share_partial and enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # cached tokens a prefix hit recomputes all the same (their KV is not written again): 1 for speculative
        # decoding, whose draft layer needs the main model's hidden state at the last cached position (`mtp_draft`)
        self.hit_overlap = 0
        self.reset()

    # ---- bookkeeping -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every block and forget every prefix key (call on weight updates and after sleep). Constant time
        (it runs twice per RL step, and a large cache has hundreds of thousands of blocks): blocks keep their stale
        fields, which nothing reads until `_take_free` hands them out again (a key counts only while `hash_to_block`
        maps it to that block)."""
        self.hash_to_block: dict[int, int] = {}
        # blocks never handed out since the reset: ids next_fresh..N-1, given first (they hold nothing worth keeping)
        self.next_fresh = 0
        # blocks freed since, least recently freed first; an OrderedDict so that reviving a cached block is O(1)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict()

    def resize(self, num_blocks: int) -> None:
        """Change the number of blocks (the KV cache was re-sized while asleep); forgets everything, as reset."""
        if num_blocks < 1:
            raise ValueError(f"BlockManager.resize: num_blocks={num_blocks}; must be >= 1")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.reset()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.blocks) - self.next_fresh

    def _register(self, block: Block, key: int, token_ids: list[int]) -> None:
        if block.hash is not None:
            self._unregister(block)
        old = self.hash_to_block.get(key)
        if old is not None and old != block.block_id:
            self.blocks[old].hash = None
        block.hash, block.token_ids = key, list(token_ids)
        self.hash_to_block[key] = block.block_id

    def _unregister(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, []

    def _take_free(self) -> Block:
        """A fresh block: one untouched since the reset, else the least recently freed one; its old key is dropped."""
        if self.next_fresh < len(self.blocks):
            block = self.blocks[self.next_fresh]
            self.next_fresh += 1
        elif self.free_block_ids:
            block = self.blocks[self.free_block_ids.popitem(last=False)[0]]
        else:
            raise IndexError("BlockManager: no free KV block (callers check can_allocate/can_append first)")
        self._unregister(block)
        block.ref_count = 1
        return block

    def _lookup(self, key: int, token_ids: list[int]) -> Block | None:
        block_id = self.hash_to_block.get(key)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return self.blocks[block_id]

    # ---- prefill ----------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        """Conservative: as many free blocks as the sequence has, prefix hits not counted."""
        return self.num_free_blocks >= seq.num_blocks(self.block_size)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table, reusing cached blocks for its longest cached prefix.

        Sets `seq.num_cached_tokens`; at least the last token is always recomputed, since its logits are
        needed (the runner then skips writing its KV, which the cached block already holds).
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        bs, prefix, miss, cached = self.block_size, _salt(seq), not self.enable_prefix_caching, 0
        for i in range(seq.num_blocks(bs)):
            tokens = seq.block_tokens(i, bs)
            partial = len(tokens) < bs
            key = None
            if self.enable_prefix_caching and (not partial or self.share_partial):
                key = block_hash(prefix, tokens, partial)
            block = None if miss or key is None else self._lookup(key, tokens)
            if block is None:
                miss = True
                block = self._take_free()
                if key is not None:
                    self._register(block, key, tokens)
            else:
                cached += len(tokens)
                if block.ref_count == 0:
                    del self.free_block_ids[block.block_id]
                block.ref_count += 1
            prefix = key
            seq.block_table.append(block.block_id)
        seq.num_kv_cached = cached
        seq.num_cached_tokens = min(max(0, cached - self.hit_overlap), len(seq) - 1)
        if seq.num_deallocations == 0:          # its first allocation: how much of its prompt the cache held
            seq.num_prefix_hit_tokens = min(cached, len(seq) - 1)      # (recomputed overlap included)
        seq.tail_private = False

    def fork(self, seq: Sequence, followers: list[Sequence]) -> None:
        """Give each of `followers` (the same prompt as `seq`, no blocks) `seq`'s block table, whose prompt's KV is
        computed (`Scheduler`'s forks): every block shared, the partial last one copied at its first append
        (`may_append`), as prefix caching shares the `n` samples' blocks."""
        for block_id in seq.block_table:
            self.blocks[block_id].ref_count += len(followers)
        for follower in followers:
            if follower.block_table or follower.token_ids != seq.token_ids:
                raise RuntimeError(f"fork: sequence {follower.seq_id} holds blocks or another prompt than "
                                   f"{seq.seq_id}; this is a bug")
            follower.block_table = list(seq.block_table)
            follower.num_cached_tokens = follower.num_kv_cached = len(follower)
            follower.num_prefix_hit_tokens = len(follower) - 1       # (as a prefix hit counts it)
            follower.tail_private = False

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go back to the free list (keys kept)."""
        self._drop_refs(seq.block_table)
        seq.block_table = []
        seq.tail_private = False
        seq.num_cached_tokens = seq.num_kv_cached = seq.num_scheduled_tokens = 0
        seq.num_deallocations += 1

    def _drop_refs(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

    # ---- finished sequences (a hybrid model keeps some for the prompts that continue them: `StateBlockManager`) --
    def release_finished(self, seq: Sequence) -> None:
        """A sequence ended: its blocks go (their keys stay for prefix hits)."""
        self.deallocate(seq)

    def make_room(self, blocks: int, keep: Sequence | None = None) -> None:
        """Give up kept finished sequences until `blocks` blocks are free (`StateBlockManager`); none here."""

    def admits(self, seq: Sequence, extra: int) -> bool:
        """Whether `seq`'s blocks fit with `extra` more left free (the scheduler's reservation for the sequences
        admitted): counted whole here, prefix hits not counted."""
        return self.num_free_blocks - seq.num_blocks(self.block_size) >= extra

    def evict_one(self) -> bool:
        """Give up the least recently kept finished sequence; False when none is kept (none here)."""
        return False

    @property
    def holds_cache(self) -> bool:
        """Whether KV computed by the current weights is kept for later prompts (a weight load must drop it)."""
        return bool(self.hash_to_block)

    # ---- decode -----------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot for `seq`'s last token (appended, KV not yet computed) can be provided."""
        table = seq.block_table
        if (len(seq.token_ids) - 1) // self.block_size >= len(table):
            return self.num_free_blocks > 0
        return self.blocks[table[-1]].ref_count == 1 or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make the block of `seq`'s last token exist and belong to `seq` alone; returns KV copies to do.

        A new block is taken when the last token starts one; a shared partial block is copied
        (copy-on-write); a private block whose content changes loses its prefix key; a block the token
        fills is keyed as a full block so later prompts can reuse it. Runs for every sequence at every
        decode step, so the common case (a private block with room) does nothing else.
        """
        bs, n, table = self.block_size, len(seq.token_ids), seq.block_table
        copies: list[tuple[int, int]] = []
        if (n - 1) // bs >= len(table):
            block = self._take_free()
            table.append(block.block_id)
        else:
            block = self.blocks[table[-1]]
            if block.ref_count > 1:
                new = self._take_free()
                block.ref_count -= 1
                copies.append((block.block_id, new.block_id))
                table[-1] = new.block_id
                block = new
            elif block.hash is not None:
                self._unregister(block)
        if n % bs == 0 and seq.token_ids[-1] != PENDING:   # keyed when the pending token arrives (engine `_resolve`)
            self.register_full(seq, len(table) - 1)
        seq.tail_private = True     # until the next token starts a block, nothing here needs doing again
        return copies

    def _blocks_short(self, seq: Sequence, extra: int) -> int:
        return max(0, -(-(len(seq.token_ids) + extra) // self.block_size) - len(seq.block_table))

    def can_append_slots(self, seq: Sequence, extra: int) -> bool:
        """Whether slots for `seq`'s last token and `extra` tokens after it can be provided (speculative decoding's
        verify step: the drafts' slots)."""
        return self.num_free_blocks >= self._blocks_short(seq, extra)

    def append_slots(self, seq: Sequence, extra: int) -> None:
        """Give `seq` the blocks for its last token and `extra` after it. Speculative decoding only: partial blocks
        are never shared there (`share_partial=False`) and a keyed full block is never written again (its tokens'
        KV is computed), so the slots written are always in private blocks, and nothing is copied or unkeyed."""
        for _ in range(self._blocks_short(seq, extra)):
            seq.block_table.append(self._take_free().block_id)
        last = (len(seq.token_ids) - 1) // self.block_size
        if self.blocks[seq.block_table[last]].ref_count > 1:
            raise RuntimeError(f"sequence {seq.seq_id}: the block of its next token is shared; this is a bug "
                               "(speculative decoding runs without shared partial blocks)")

    def register_full(self, seq: Sequence, i: int) -> None:
        """Key `seq`'s full block `i` so later prompts can reuse it (when the blocks before it are keyed)."""
        table = seq.block_table
        if not self.enable_prefix_caching or i >= len(table):
            return
        prev = self.blocks[table[i - 1]].hash if i > 0 else _salt(seq)
        if i == 0 or prev is not None:
            tokens = seq.block_tokens(i, self.block_size)
            self._register(self.blocks[table[i]], block_hash(prev, tokens, False), tokens)
