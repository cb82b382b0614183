"""One sequence being generated: its tokens, sampled log-probs, status and KV `block_table`.

A request of the `Rollout` interface (one prompt, `n` samples) becomes `n` sequences; each carries its
own sampling settings and its own `seed`: the uniform number behind output token t is a hash of
(seed, t), so what it samples never depends on which other sequences share its batch, nor on
preemption (nano-vllm / vLLM's `Sequence`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto


PENDING = -1    # a token sampled on the device whose value has not reached the host yet (the engine's overlap)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class SequenceParams:
    """The per-sequence part of `SamplingParams`, resolved once (stop ids include EOS unless `ignore_eos`)."""

    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Prompt + generated tokens. `token_ids[num_prompt_tokens:]` are the outputs.

    `num_cached_tokens` counts leading tokens whose KV was found in the prefix cache at allocation
    (prefill skips them); `block_table[i]` is the KV block holding tokens `i*block_size ... (i+1)*block_size-1`.
    """

    prompt_token_ids: list[int]
    params: SequenceParams = field(default_factory=SequenceParams)
    seed: int | None = None               # sampling seed; None for greedy
    index: int = 0                        # position in the output (prompt-major)
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0            # leading tokens prefill skips
    num_kv_cached: int = 0                # leading tokens whose KV the cache already holds (>= the above)
    num_scheduled_tokens: int = 0         # prompt tokens the current prefill step computes (chunked prefill)
    num_deallocations: int = 0            # bumped when its blocks are freed: a new block table follows
    num_prefix_hit_tokens: int = 0        # prompt tokens its first prefill found in the prefix cache
    num_preemptions: int = 0              # times the scheduler preempted it for KV room (not weight-sync interrupts)
    tail_private: bool = False            # its last block is its own and unkeyed (`BlockManager.may_append`)
    length_limit: int = 1 << 62           # len(token_ids) at which it ends (max_tokens, max_model_len)
    finish_reason: str | None = None
    mm: object | None = None              # `multimodal.MultiModalPrompt` of an image prompt (shared by its samples)
    # the `n` samples of a text prompt where prefix caching is off (`Scheduler`'s forks): the first sample's prefill
    # serves the rest, which wait in its `followers` (outside the queue) until its prompt is computed
    leader: Sequence | None = None
    followers: list[Sequence] = field(default_factory=list)
    # a streamed request's sequence on a hybrid model: kept when it finishes, for a later prompt that continues it
    # (`linear_state.StateBlockManager`), with the number of its leading tokens its KV and states have taken in
    parkable: bool = False
    num_fed: int = 0
    park_hashes: tuple = field(default=((), ()), repr=False)     # `linear_state.prefix_hashes`' memo: (tokens, hashes)
    # speculative decoding (`spec_step.py`): the main model's hidden states at the positions whose MTP entries wait
    # for their next token (the last committed tokens), the leading blocks keyed so far, and the draft statistics
    spec_hidden: object | None = None
    spec_keyed: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_verifies: int = 0

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {self.seq_id}: empty prompt; every prompt needs at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def lookahead(self, num_drafts: int) -> int:
        """Draft tokens a speculative step may propose: at most `num_drafts`, and none that could take the
        sequence past its length limit (its last emitted token may be the limit's)."""
        return max(0, min(num_drafts, self.length_limit - len(self.token_ids) - 1))

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """The tokens of logical block `i` (the last one may be partial)."""
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
