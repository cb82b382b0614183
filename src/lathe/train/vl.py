"""What the actor worker does differently for a vision-language policy (`lathe.models.vl`): the refusals of what it
does not do yet, and verl's `actor.freeze_vision_tower`."""

from __future__ import annotations

import torch

from lathe.models.rope import cast_keeping_rope
from lathe.models.vl import is_vl


def freeze_vision_tower(model, dtype: torch.dtype, *, sharded: bool) -> None:
    """verl's `actor.freeze_vision_tower`: the vision tower (patch embedding, blocks, merger) takes no gradient and stays
    out of the optimizer; on one device it is held in the compute dtype, as a frozen LoRA base is."""
    if getattr(model.config, "vl_checkpoint", None) is not None:
        return          # a VL checkpoint's language model run alone: its vision tower is not trained (kept as read)
    if not is_vl(model):
        raise ValueError("actor_rollout_ref.actor.freeze_vision_tower=true: the policy is a text model, which has no "
                         "vision tower. Fix: remove the key (or set it to false).")
    model.model.visual.requires_grad_(False)
    if not sharded:
        cast_keeping_rope(model.model.visual, dtype)


def check_vl(actor, arr, *, rollout: bool) -> None:
    """What a vision-language actor does not do yet, refused before anything runs. It generates with lathe's engine
    (`build_engine`; `generate_sequences` hands it each prompt's `multi_modal_inputs`), single-turn or in the agent
    loop (`multi_turn.enable`: every turn carries its prompt's images; tools answer text, and one that returns an
    image stops the run, `lathe.rollout.agent.tools.ToolImageError`); fully-async training's rollout replicas check
    it too (`lathe.workers.fully_async.RolloutWorker`, whose requests carry the images)."""
    what = f"actor_rollout_ref.model.path is a vision-language checkpoint ({actor.config.architecture})"
    refused = [
        (rollout and arr.rollout.name == "hf", "actor_rollout_ref.rollout.name=hf",
         "the transformers rollout does not take image prompts; set actor_rollout_ref.rollout.name=auto (or lathe)"),
    ]
    for on, key, fix in refused:
        if on:
            raise NotImplementedError(f"{key} with a vision-language model is not implemented yet ({what}). "
                                      f"Fix: {fix}.")
