"""Cross-field rules of partial activation recomputation (a model group's `gradient_checkpointing_layers`), checked
before any model loads: the count acts only under `enable_gradient_checkpointing`, and only on lathe's decoder.

A count above the model's layer count is not an error: it recomputes every layer (`lathe.models.decoder.
recomputes`), as Megatron's block method reads a count past its layers. The layer count is only known once the
model's config.json is read (after these checks), and one count may serve models of several depths (an actor and a
critic of different sizes, a preset used over a model family), so refusing it would be a late error about a
harmless value.
"""

from __future__ import annotations

from .errors import ProblemList

ENABLE, LAYERS = "enable_gradient_checkpointing", "gradient_checkpointing_layers"


def recompute_problems(model, group: str, impl: str | None = None, impl_key: str = "") -> list[str]:
    """What is wrong with `model`'s (a model group at dotted `group`) recomputed-layer count: negative, set while
    gradient checkpointing is off (it would act on nothing), or set for a model `impl`=hf runs through transformers."""
    layers = getattr(model, LAYERS)
    if layers is None:
        return []
    key = f"{group}.{LAYERS}"
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        return [f"{key}={layers!r}: give the number of decoder layers that recompute (an integer >= 0; 0 = none), "
                "or null (every layer)."]
    if not getattr(model, ENABLE):
        return [f"{key}={layers} picks which decoder layers gradient checkpointing recomputes, but {group}.{ENABLE}"
                f"=false turns gradient checkpointing off, so the count would act on nothing. Fix: set {group}."
                f"{ENABLE}=true (the first {layers} layers then recompute), or remove {key}."]
    if impl == "hf":
        return [f"{key}={layers}: only lathe's decoder recomputes part of its layers, and {impl_key}=hf trains "
                f"through transformers. Fix: remove {key}, or set {impl_key}=auto (lathe's decoder for the "
                "architectures it implements)."]
    return []


def check_recompute(cfg, problems: ProblemList) -> None:
    """The actor's and the critic's counts (`lathe train`); the critic's model runs with the actor's impl."""
    impl, impl_key = cfg.actor_rollout_ref.model.impl, "actor_rollout_ref.model.impl"
    for model, group in ((cfg.actor_rollout_ref.model, "actor_rollout_ref.model"), (cfg.critic.model, "critic.model")):
        for message in recompute_problems(model, group, impl, impl_key):
            problems.add(message)
