"""Continuous batching (nano-vllm / vLLM's scheduler): each step is either a prefill or a decode.

Prefill first: waiting sequences are admitted, in order, while there is room (`max_num_seqs`,
`max_num_batched_tokens`, free KV blocks). With chunked prefill, a prompt longer than what is left of the
step's token budget is computed in chunks over several steps (`seq.num_scheduled_tokens` says how many
this step); it decodes only once its whole prompt is in the cache. Without it, a prompt longer than the
budget runs alone in one step. Otherwise every running sequence decodes one token; when a
sequence's next slot cannot be had, the most recently admitted running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue with its tokens
(prompt + output so far), to be prefilled again later.
"""

from __future__ import annotations

from collections import deque

from lathe.engine.block_manager import BlockManager
from lathe.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None     # admitted, part of its prompt still to compute
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and self.prefilling is None

    def add(self, seq: Sequence) -> None:
        bs, need = self.block_manager.block_size, len(seq) + seq.params.max_tokens
        if (need + bs - 1) // bs > self.block_manager.num_blocks:
            raise ValueError(f"sequence {seq.seq_id}: {len(seq)} prompt tokens + max_tokens={seq.params.max_tokens} "
                             f"need {(need + bs - 1) // bs} KV blocks of {bs}, the cache has "
                             f"{self.block_manager.num_blocks}; raise gpu_memory_utilization/num_kv_blocks or "
                             "lower max_tokens")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        """(sequences, is_prefill, KV block copies to do before running them).

        A prefill sets each sequence's `num_scheduled_tokens`; `prefill_done` must be called after it runs."""
        scheduled, budget = [], self.max_num_batched_tokens
        if self.prefilling is not None:
            seq, self.prefilling = self.prefilling, None
            budget -= self._chunk(seq, budget)
            scheduled.append(seq)
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if scheduled and not self.enable_chunked_prefill and len(seq) > budget:
                break       # upper bound; prefix hits are found at allocation
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            budget -= self._chunk(seq, budget)
            seq.status = SequenceStatus.RUNNING
            scheduled.append(self.waiting.popleft())
        if scheduled:
            return scheduled, True, []
        if not self.running:
            raise RuntimeError("scheduler: sequences wait but none fits in the KV cache even alone; this is a bug "
                               "(add() checks each sequence fits)")
        return self._schedule_decode()

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule the next tokens of `seq`'s prefill within `budget` (all of them without chunking)."""
        todo = len(seq) - seq.num_cached_tokens
        seq.num_scheduled_tokens = min(todo, budget) if self.enable_chunked_prefill else todo
        return seq.num_scheduled_tokens

    def prefill_done(self, seqs: list[Sequence]) -> list[Sequence]:
        """Record a prefill step's progress; returns the sequences whose prompt is now complete (to sample).
        An incomplete one (at most one: the budget ran out on it) continues first at the next step."""
        complete = []
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_kv_cached = max(seq.num_kv_cached, seq.num_cached_tokens)
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq):
                self.prefilling = seq
            else:
                self.running.append(seq)
                complete.append(seq)
        return complete

    def _schedule_decode(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        scheduled, copies = [], []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                copies.extend(self.block_manager.may_append(seq))
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False, copies

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it first in line; it is recomputed from its tokens when readmitted."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
