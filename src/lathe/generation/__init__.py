"""What the engine and the rollout backends speak: a generate call's `SamplingParams` in, its `RolloutOutput`
out, and the stop-string rule (`lathe.generation.stop`).

A leaf: it imports nothing from lathe, so `engine/` (which produces these) and `rollout/` (which builds
engines and wraps other backends around the same types) both depend on it and not on each other.
"""

from lathe.generation.sampling import RolloutOutput, SamplingParams

__all__ = ["RolloutOutput", "SamplingParams"]
