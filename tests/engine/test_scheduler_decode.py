"""The scheduler's decode step (`Scheduler._schedule_decode`): where the free blocks cover every sequence that needs
one, its quick form schedules exactly what the preempting loop (`_schedule_decode_preempting`) would, in the same
order, with the same copies and block tables; where they do not, it is that loop."""

import copy
import random

from lathe.engine.block_manager import BlockManager
from lathe.engine.scheduler import Scheduler
from lathe.engine.sequence import Sequence, SequenceParams


def _state(s: Scheduler) -> tuple:
    bm = s.block_manager
    return ([q.seq_id for q in s.running], [q.seq_id for q in s.waiting],
            [(q.seq_id, list(q.block_table), q.tail_private) for q in s.running],
            [(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_block_ids), bm.next_fresh)


def _run(blocks: int, *, prefix_caching: bool, seed: int, reserve: bool = True) -> tuple[int, int, int]:
    """A random load decoded step by step; at each decode step the scheduler and the preempting loop run on copies of
    the same state and must agree. Returns how many decode steps took the quick form and how many the loop, and the
preemptions."""
    rng = random.Random(seed)
    s = Scheduler(BlockManager(blocks, 4, enable_prefix_caching=prefix_caching), max_num_seqs=16,
                  reserve_new_tokens=reserve)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 11))] for _ in range(5)]
    for p in prompts:       # samples of a prompt share its blocks, a partial last one too (prefix keys, or forks)
        first = None
        for _ in range(3):
            seq = Sequence(list(p), SequenceParams(max_tokens=rng.randrange(4, 20)), None,
                           leader=None if prefix_caching else first)
            first = first or seq
            s.add(seq)
    loop, calls = Scheduler._schedule_decode_preempting, []

    def counted(self):
        calls.append(self)
        return loop(self)
    Scheduler._schedule_decode_preempting = counted
    quick = looped = 0
    try:
        for _ in range(400):
            if s.is_finished():
                break
            other = copy.deepcopy(s)
            seqs, prefill, copies = s.schedule()
            if prefill:
                s.prefill_done(seqs)
                continue
            took_loop = bool(calls)
            want = other._schedule_decode_preempting()
            calls.clear()
            assert [q.seq_id for q in seqs] == [q.seq_id for q in want[0]] and copies == want[2]
            assert _state(s) == _state(other)
            looped, quick = looped + took_loop, quick + (not took_loop)
            _decode(s, seqs, rng)
    finally:
        Scheduler._schedule_decode_preempting = loop
    return quick, looped, s.num_preemptions


def _decode(s: Scheduler, seqs: list[Sequence], rng: random.Random) -> None:
    for q in seqs:                              # each samples a token; the ones at their length end
        q.token_ids.append(rng.randrange(1, 50))
        if (len(q.token_ids) - 1) % 4 == 0:
            q.tail_private = False                  # (the engine keys the block the token filled: `_resolve`)
        if q.num_output_tokens >= q.params.max_tokens:
            s.finish(q, "length")


def test_the_quick_decode_step_schedules_what_the_preempting_loop_would():
    for seed in range(6):
        for prefix_caching in (True, False):
            quick, looped, preemptions = _run(400, prefix_caching=prefix_caching, seed=seed)
            assert quick > 10 and looped == preemptions == 0


def test_short_of_blocks_the_decode_step_is_the_preempting_loop():
    """With few blocks, admitted without reserving room for their growth, some steps take the loop (and preempt), the
    others the quick form; each agrees with the loop."""
    runs = [_run(14, prefix_caching=prefix_caching, seed=seed, reserve=False)
            for seed in range(6) for prefix_caching in (True, False)]
    quick, looped, preemptions = (sum(r[i] for r in runs) for i in range(3))
    assert quick > 0 and looped > 0 and preemptions > 0
