"""The scheduler's call plan (`Scheduler._plan_call`, `OVERCOMMIT`) on a bare block manager: when it starts a
call from 1/OVERCOMMIT, how it counts the blocks of prompts shared by neighbouring samples, and when it abstains."""

from lathe.engine import scheduler as sched
from lathe.engine.block_manager import BlockManager
from lathe.engine.scheduler import Scheduler
from lathe.engine.sequence import Sequence, SequenceParams


def _scheduler(blocks: int, max_num_seqs: int = 64) -> Scheduler:
    return Scheduler(BlockManager(blocks, 4), max_num_seqs=max_num_seqs)


def _call(s: Scheduler, prompts: list[list[int]], n: int, max_tokens: int) -> None:
    s.new_call()
    params = SequenceParams(max_tokens=max_tokens)
    for p in prompts:
        for _ in range(n):
            s.add(Sequence(list(p), params, None))


# 2 prompts of 8 tokens (2 full blocks each) x 4 samples, max_tokens 20: at 100% each sample grows by
# 5 blocks, at 80% (16 tokens) by 4. Demand: 2 * 2 prompt blocks + 8 * 5 = 44 blocks; at 80%: 4 + 8 * 4 = 36.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def test_the_plan_starts_from_one_over_overcommit_when_the_whole_load_fits_there():
    for blocks, expected in ((44, 1.0), (40, 1 / sched.OVERCOMMIT), (36, 1 / sched.OVERCOMMIT), (35, 1.0)):
        s = _scheduler(blocks)
        _call(s, PROMPTS, n=4, max_tokens=20)
        s.schedule()
        assert s.expected_fraction == expected, f"{blocks} blocks"


def test_samples_count_their_prompt_once_only_when_neighbours():
    # the same two prompts interleaved (a, b, a, b, ...): each sample counts its prompt, 8 * 2 + 32 = 48 at 80%
    s = _scheduler(40)
    s.new_call()
    params = SequenceParams(max_tokens=20)
    for _ in range(4):
        for p in PROMPTS:
            s.add(Sequence(list(p), params, None))
    s.schedule()
    assert s.expected_fraction == 1.0


def test_the_plan_abstains_beyond_max_num_seqs_and_without_a_new_call():
    s = _scheduler(40, max_num_seqs=6)
    _call(s, PROMPTS, n=4, max_tokens=20)
    s.schedule()
    assert s.expected_fraction == 1.0            # 8 sequences, 6 may run: the load cannot be admitted at once
    s = _scheduler(40)
    params = SequenceParams(max_tokens=20)
    for p in PROMPTS:
        for _ in range(4):
            s.add(Sequence(list(p), params, None))
    s.schedule()
    assert s.expected_fraction == 1.0            # no `new_call`: nothing asked the first admission to plan


def _forked_call(s: Scheduler, prompts: list[list[int]], n: int, max_tokens: int) -> list[Sequence]:
    """Each prompt's samples as a hybrid engine makes them: the first leads, the others follow (`Sequence.leader`)."""
    s.new_call()
    params, seqs = SequenceParams(max_tokens=max_tokens), []
    for p in prompts:
        for j in range(n):
            seqs.append(Sequence(list(p), params, None, leader=None if j == 0 else seqs[-j]))
            s.add(seqs[-1])
    return seqs


def test_forked_samples_count_as_the_samples_they_are():
    """A leader's followers (outside the queue) count in the plan as neighbouring samples do (the prompt's blocks
    once, each one's growth), in admission as seats, and each gets its private copy of a partial last block."""
    for blocks, expected in ((44, 1.0), (40, 1 / sched.OVERCOMMIT), (36, 1 / sched.OVERCOMMIT), (35, 1.0)):
        s = Scheduler(BlockManager(blocks, 4, enable_prefix_caching=False), max_num_seqs=64)
        seqs = _forked_call(s, PROMPTS, n=4, max_tokens=20)
        assert len(s.waiting) == 2 and [len(q.followers) for q in seqs[::4]] == [3, 3]
        s.schedule()
        assert s.expected_fraction == expected, f"{blocks} blocks"
    s = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=6)
    leader = _forked_call(s, [[1, 2, 3, 4, 5, 6]], n=4, max_tokens=20)[0]      # 2 blocks, the second partial
    assert s._growth(leader, 1.0) == 4 * 5 + 3                  # 26 tokens: 7 blocks each, 3 copies of the tail
    _forked_call(s, PROMPTS[:1], n=3, max_tokens=20)
    scheduled, prefill, _ = s.schedule()
    assert prefill and scheduled == [leader]                    # 4 seats: the next group's 3 would make 7
    complete = s.prefill_done(scheduled)
    assert complete[0] is leader and all(f.leader is leader for f in complete[1:]) and len(complete) == 4
    assert all(s.block_manager.blocks[b].ref_count == 4 for b in leader.block_table)
    assert all(f.block_table == leader.block_table and f.num_cached_tokens == 6 for f in complete[1:])
    scheduled, prefill, _ = s.schedule()
    assert not prefill and len(scheduled) == 4 and len(s.waiting) == 1     # the 4 decode, the group waits
