"""Continuous batching (nano-vllm / vLLM's scheduler): each step is either a prefill or a decode.

Prefill first: waiting sequences are admitted, in order, while there is room (`max_num_seqs`,
`max_num_batched_tokens`, free KV blocks). With chunked prefill, a prompt longer than what is left of the
step's token budget is computed in chunks over several steps (`seq.num_scheduled_tokens` says how many
this step); it decodes only once its whole prompt is in the cache. Without it, a prompt longer than the
budget runs alone in one step. Otherwise every running sequence decodes one token; when a
sequence's next slot cannot be had, the most recently admitted running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue with its tokens
(prompt + output so far), to be prefilled again later.

Admission reserves room to grow (`reserve_new_tokens`, SGLang's new-token-ratio idea): a waiting sequence is
admitted only if, after its prompt's blocks, the free blocks still cover what every admitted sequence is
expected to append: `expected_fraction` of its remaining `max_tokens`. Each `generate` call starts at 1 (no
preemption at all while nothing is known), then follows the response lengths seen (a moving average of
`output tokens / max_tokens` over the call's finished sequences); a preemption raises it for the rest of the
call. A call whose whole load overflows the free blocks by a little is admitted at once instead (`OVERCOMMIT`): at
its first admission, if every waiting sequence fits when each response is expected to reach 1/OVERCOMMIT of its
`max_tokens`, that is the starting estimate; the few sequences that outgrow the cache near the end are preempted
and finish after the rest. Holding them back instead would cost a second wave of decode steps as long as the first,
far more than the few preemptions. When the overflow is larger the plan keeps the full reservation: admitting more
there brings the second wave back and many preemptions with it (`bench/rollout.py` measures both).
Nothing carries from one call to the next, so admission (and batch composition) depends on the call's
inputs only and a resumed run batches as an uninterrupted one. Without the reservation a GRPO load admits every
prompt whose prompt fits, then preempts hundreds of them as the responses grow (each one recomputed).
(Streamed requests, `lathe.engine.stream`, start the statistics afresh only when they find the engine idle.)

Prefill batching (`prefill_interval`, SGLang/vLLM's scheduling delay): while sequences decode, newly waiting ones
are admitted only every `prefill_interval` decode steps (or at once when as many wait as a quarter of the running
batch), so that requests arriving one by one (the agent loop's next turns) share a prefill step instead of each
pausing every decode for a step of its own. It changes when a sequence starts, not what it samples (up to the
last bits of batch-dependent logits). 1 (the default) admits at every step.

Forks (where prefix caching is off: always for hybrid models, `linear_state.py`): the `n` samples of a text prompt
come as a leader and its followers (`Sequence.leader`). Only the leader queues; its followers wait in
`leader.followers` and are admitted with it (its group's seats and expected growth counted at once, each follower's
private copy of the prompt's partial last block included). When the leader's prompt is computed (`prefill_done`)
each follower shares its blocks (on a hybrid model, copies of its linear-attention states too: `BlockManager.fork`),
and samples its first token from the leader's logits: a prompt is prefilled once for its `n` samples, as the prefix
cache would share it. A follower preempted later is recomputed from its own tokens, like any sequence.

`preempt_all` empties the KV cache for a weight sync (partial rollout): every sequence holding blocks goes back
to the waiting queue, its tokens kept; that is not memory pressure, so neither counted nor boosting the reservation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from lathe.engine.block_manager import BlockManager
from lathe.engine.sequence import Sequence, SequenceStatus


LENGTH_EMA = 1 / 64          # weight of one finished sequence in the response-length average
PREEMPTION_BOOST = 0.25      # added to the expected fraction by each preemption (until the call ends)
OVERCOMMIT = 1.25            # a call's whole load is admitted at once if it fits with responses at 1/OVERCOMMIT


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 16384,
                 enable_chunked_prefill: bool = True, reserve_new_tokens: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.reserve_new_tokens = reserve_new_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None     # admitted, part of its prompt still to compute
        self.num_preemptions = 0
        self.length_fraction = 1.0                  # moving average of output tokens / max_tokens when finished
        self.boost = 0.0                            # raised by preemptions; both reset by `new_call`
        self.plan_pending = False                   # `new_call` asks the first admission to size the whole load
        self.on_finish: Callable[[Sequence], None] | None = None     # told of each sequence `finish` ends
        self.on_release: Callable[[Sequence], None] | None = None    # ... before its blocks are freed
        self.prefill_interval = 1                   # decode steps between admissions while sequences run
        self.decodes_since_prefill = 0
        self.num_steps = {"prefill": 0, "decode": 0}     # steps scheduled, for benchmarks
        self.num_prefill_tokens = 0                 # prompt tokens prefill steps computed (`rollout/prefill_tokens`)
        # speculative decoding: draft tokens a decode step verifies after each sequence's last token; the step
        # reserves their slots too (`Sequence.lookahead`: fewer near the length limit)
        self.num_lookahead_slots = 0

    def new_call(self) -> None:
        """A `generate` call starts: forget the last call's lengths and preemptions."""
        self.length_fraction, self.boost, self.plan_pending = 1.0, 0.0, True

    def _plan_call(self) -> None:
        """The call's first admission: start from 1/OVERCOMMIT instead of 1 when that admits every waiting
        sequence but 1 would not. The `n` samples of a prompt (neighbours in the queue, or a leader's followers)
        count the prompt's blocks once, as the prefix cache or a fork shares them."""
        self.plan_pending = False
        waiting, bs = list(self.waiting), self.block_manager.block_size
        if not waiting or len(self.running) + sum(self._seats(s) for s in waiting) > self.max_num_seqs:
            return
        prompt_blocks = sum(seq.num_blocks(bs) for i, seq in enumerate(waiting)
                            if i == 0 or seq.token_ids != waiting[i - 1].token_ids)

        def demand(fraction: float) -> int:
            return prompt_blocks + sum(self._growth(s, fraction) for s in (*self.running, *waiting))
        free, optimistic = self.block_manager.num_free_blocks, 1 / OVERCOMMIT
        if demand(1.0) > free >= demand(optimistic):
            self.length_fraction = optimistic

    @property
    def expected_fraction(self) -> float:
        """The fraction of its remaining `max_tokens` each admitted sequence is expected to still append."""
        return min(1.0, max(self.length_fraction, self.boost))

    def _growth(self, seq: Sequence, fraction: float) -> int:
        """Blocks `seq` is expected to take beyond those its current tokens fill; plus one for the private copy
        of a partial last block that the `n` samples of a prompt share (copy-on-write at the first append). A
        leader's followers (not yet forked) count as many again each, their private copies included."""
        bs = self.block_manager.block_size
        remaining = max(0, seq.params.max_tokens - seq.num_output_tokens)
        expected = len(seq) + math.ceil(fraction * remaining)
        partial = remaining > 0 and len(seq) % bs != 0
        cow = int(self.block_manager.share_partial and partial)
        own = max(0, (expected + bs - 1) // bs - seq.num_blocks(bs)) + cow
        return own + len(seq.followers) * (own - cow + int(partial))

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running places `seq` takes once admitted: its own and its followers'."""
        return 1 + len(seq.followers)

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
        leader = seq.leader
        if leader is not None and leader.status == SequenceStatus.WAITING and leader.num_deallocations == 0 \
                and not leader.block_table and self._seats(leader) < self.max_num_seqs:
            leader.followers.append(seq)         # admitted with its leader, forked when the prompt is computed
            return
        seq.leader = None                        # (a group larger than max_num_seqs: the rest prefill themselves)
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        """(sequences, is_prefill, KV block copies to do before running them).

        A prefill sets each sequence's `num_scheduled_tokens`; `prefill_done` must be called after it runs."""
        scheduled, budget = [], self.max_num_batched_tokens
        if self.prefilling is not None:
            seq, self.prefilling = self.prefilling, None
            budget -= self._chunk(seq, budget)
            scheduled.append(seq)
        reserved = None     # blocks the admitted sequences are expected to append (computed once, if needed)
        if self.plan_pending and self.reserve_new_tokens and self.waiting:
            self._plan_call()
        fraction = self.expected_fraction
        if not scheduled and self._hold_prefill():
            return self._schedule_decode()
        seats = len(self.running) + sum(self._seats(s) for s in scheduled)
        while self.waiting and seats + self._seats(self.waiting[0]) <= self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if scheduled and not self.enable_chunked_prefill and len(seq) > budget:
                break       # upper bound; prefix hits are found at allocation
            if not self.block_manager.can_allocate(seq):
                break
            if self.reserve_new_tokens and (self.running or scheduled):
                if reserved is None:
                    reserved = sum(self._growth(s, fraction) for s in (*self.running, *scheduled))
                grow = self._growth(seq, fraction)
                if not self.block_manager.admits(seq, reserved + grow):
                    break
                reserved += grow
            self.block_manager.allocate(seq)
            budget -= self._chunk(seq, budget)
            seq.status = SequenceStatus.RUNNING
            seats += self._seats(seq)
            scheduled.append(self.waiting.popleft())
        if scheduled:
            self.decodes_since_prefill = 0
            self.num_steps["prefill"] += 1
            return scheduled, True, []
        if not self.running:
            raise RuntimeError("scheduler: sequences wait but none fits in the KV cache even alone; this is a bug "
                               "(add() checks each sequence fits)")
        return self._schedule_decode()

    def _hold_prefill(self) -> bool:
        """Prefill batching: keep decoding while few sequences wait and the interval has not passed."""
        return (self.prefill_interval > 1 and bool(self.running) and bool(self.waiting)
                and self.decodes_since_prefill < self.prefill_interval - 1
                and len(self.waiting) * 4 < len(self.running))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Schedule the next tokens of `seq`'s prefill within `budget` (all of them without chunking)."""
        todo = len(seq) - seq.num_cached_tokens
        seq.num_scheduled_tokens = min(todo, budget) if self.enable_chunked_prefill else todo
        return seq.num_scheduled_tokens

    def prefill_done(self, seqs: list[Sequence]) -> list[Sequence]:
        """Record a prefill step's progress; returns the sequences whose prompt is now complete (to sample): each
        complete leader followed by its followers, forked now (module doc), which sample from its logits.
        An incomplete one (at most one: the budget ran out on it) continues first at the next step."""
        complete = []
        for seq in seqs:
            self.num_prefill_tokens += seq.num_scheduled_tokens
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_kv_cached = max(seq.num_kv_cached, seq.num_cached_tokens)
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq):
                self.prefilling = seq
            else:
                self.running.append(seq)
                complete.append(seq)
                if seq.followers:
                    followers, seq.followers = seq.followers, []
                    self.block_manager.fork(seq, followers)
                    for follower in followers:
                        follower.status = SequenceStatus.RUNNING
                    self.running.extend(followers)
                    complete.extend(followers)
        return complete

    def _schedule_decode(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        self.decodes_since_prefill += 1
        self.num_steps["decode"] += 1
        bm, copies = self.block_manager, []
        bs = bm.block_size
        if self.num_lookahead_slots:
            return self._schedule_verify()
        # The sequences whose slot is not simply in their own last block (a new block, a shared or keyed one). When the
        # free blocks cover one each, none can be refused: `_schedule_decode_preempting` would preempt nothing and
        # keep the order, so its work is done here without its per-row queue traffic (host time at hundreds of rows).
        needs = [s for s in self.running if not (s.tail_private and (len(s.token_ids) - 1) % bs)]
        if len(needs) > bm.num_free_blocks:
            return self._schedule_decode_preempting()
        for seq in needs:
            copies.extend(bm.may_append(seq))
        return list(self.running), False, copies

    def _schedule_decode_preempting(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        """A decode step when the free blocks may run short: each running sequence in turn gets its slot, preempting
        the most recently admitted ones while it cannot."""
        scheduled, copies, bs = [], [], self.block_manager.block_size
        while self.running:
            seq = self.running.popleft()
            if seq.tail_private and (len(seq.token_ids) - 1) % bs:     # its slot is in its own last block
                scheduled.append(seq)
                continue
            if self._make_room(seq, self.block_manager.can_append, seq):
                copies.extend(self.block_manager.may_append(seq))
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False, copies

    def _schedule_verify(self) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        """A speculative decode step: each running sequence gets the slots of its last token and its drafts,
        preempting the most recently admitted ones (as `_schedule_decode`) while they cannot be had."""
        scheduled, bm = [], self.block_manager
        while self.running:
            seq = self.running.popleft()
            extra = seq.lookahead(self.num_lookahead_slots)
            if self._make_room(seq, bm.can_append_slots, seq, extra):
                bm.append_slots(seq, extra)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False, []

    def _make_room(self, seq: Sequence, fits, *args) -> bool:
        """Preempt the most recently admitted running sequences until `fits(*args)`; when none is left, preempt `seq`
        itself and return False (it waits to be recomputed)."""
        while not fits(*args):
            if self.block_manager.evict_one():      # a kept finished sequence gives way first
                continue
            if not self.running:
                self.preempt(seq)
                return False
            self.preempt(self.running.pop())
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it first in line; it is recomputed from its tokens when readmitted."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        self.boost = min(1.0, self.expected_fraction + PREEMPTION_BOOST)
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def preempt_all(self) -> list[Sequence]:
        """Preempt every sequence holding KV blocks (the running ones, the one mid-prefill) by recompute, so that
        none does; they wait first in line, in the order they were admitted. Returns them. A weight sync's
        interruption: not counted in `num_preemptions`, no reservation boost."""
        seqs = list(self.running)
        if self.prefilling is not None:
            seqs.append(self.prefilling)
        self.running.clear()
        self.prefilling = None
        for seq in reversed(seqs):
            seq.status = SequenceStatus.WAITING
            self.block_manager.deallocate(seq)
            self.waiting.appendleft(seq)
        return seqs

    def abandon(self) -> list[Sequence]:
        """Drop every unfinished sequence (a call that failed midway): their blocks freed, none left to run. Returns
        them."""
        self.preempt_all()                  # (the running ones and the one mid-prefill give their blocks back)
        seqs = list(self.waiting)
        self.waiting.clear()
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"
        return seqs

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (running, or waiting: preempted while its last token was still on the device)."""
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        fraction = min(1.0, seq.num_output_tokens / max(1, seq.params.max_tokens))
        self.length_fraction += LENGTH_EMA * (fraction - self.length_fraction)
        if self.on_release is not None:
            self.on_release(seq)
        self.block_manager.release_finished(seq)
        if self.on_finish is not None:
            self.on_finish(seq)
