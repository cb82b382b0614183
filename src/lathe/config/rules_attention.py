"""verl's `actor_rollout_ref.model.override_config.attn_implementation` (transformers' attention names): which packed
attention lathe's decoder trains with (`lathe.models.attention.set_attention`). Checked here by name before anything
loads; the device, the compute dtype and the flash-attn-4 package once the actor's device is known."""

from __future__ import annotations

from .errors import ProblemList

KEY = "actor_rollout_ref.model.override_config.attn_implementation"
# transformers' name -> lathe's packed backend; "eager" is the same math as SDPA, lathe's reference backend
ATTN_IMPLEMENTATIONS = {"flash_attention_2": "varlen", "flash_attention_4": "fa4", "sdpa": "sdpa", "eager": "sdpa"}


def attn_implementation_problem(value) -> str | None:
    """Why `value` of `KEY` is refused, or None (None: the key is not set)."""
    if value is None or value in ATTN_IMPLEMENTATIONS:
        return None
    why = (" lathe runs Hopper's flash kernels through flash-attn-4 (flash_attention_4), not flash-attn 3's."
           if value == "flash_attention_3" else "")
    return (f"{KEY}={value!r} is not an attention lathe's decoder runs.{why} Fix: one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)}, or leave it out (flash attention 2 on a GPU, SDPA elsewhere)")


def check_attention(cfg, problems: ProblemList) -> None:
    problem = attn_implementation_problem(cfg.actor_rollout_ref.model.override_config.get("attn_implementation"))
    if problem:
        problems.add(problem)
