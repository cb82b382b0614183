"""`SamplingParams` (vLLM's names), the one declaration of the sampling fields, and `RolloutOutput`.

Each `SamplingParams` field carries its documentation in `metadata["help"]`, where front ends (`lathe generate`)
read it together with the field's type: a new sampling field is declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _field(default: Any, help: str) -> Any:
    """A documented field (list defaults copied per instance)."""
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class SamplingParams:
    """vLLM's names. `temperature=0` or `do_sample=False` is greedy."""

    n: int = _field(1, "samples per prompt, returned consecutively")
    temperature: float = _field(1.0, "sampling temperature; 0 = greedy")
    top_p: float = _field(1.0, "nucleus sampling mass; 1 = off")
    top_k: int = _field(-1, "sample from the k most likely tokens; -1 = off")
    max_tokens: int = _field(16, "new tokens per sample at most")
    min_tokens: int = _field(0, "new tokens before EOS, stop ids or stop strings may end a sample")
    do_sample: bool = _field(True, "false = greedy, whatever the temperature")
    ignore_eos: bool = _field(False, "keep generating past EOS and stop ids")
    stop_token_ids: list[int] = _field([], "token ids that end a sample (besides EOS)")
    stop: list[str] = _field([], "stop strings; see lathe.generation.stop for the exact rule")
    seed: int | None = _field(None, "seed for reproducible sampling; null = a fresh seed")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned log-probs (and the trainer's) are computed at."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutOutput:
    """One entry per sample: `len(prompts) * n`, prompt-major (prompt 0's n samples first)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]        # "stop" (EOS, a stop id or a stop string; the stopping token is included
                                     # in token_ids) or "length"
    metrics: dict[str, float] = field(default_factory=dict)    # the backend's own, as `rollout/<name>`
    # per sample, the weight versions its tokens were sampled with: (version, index of the first output token
    # sampled with it), ascending; a partial rollout continued after a weight sync has several. None: not tracked
    # (one version throughout, as `generate`)
    versions: list[list[tuple[int, int]]] | None = None
    # per sample, routing replay's record (`lathe.engine.routing`): (prompt + response length, MoE layers, top-k)
    # int16 experts of each token, -1 where none was computed (the last token); None: not recorded
    routed_experts: list | None = None
