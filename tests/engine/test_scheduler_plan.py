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
