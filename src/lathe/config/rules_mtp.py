"""Cross-field rules of multi-token prediction (`actor_rollout_ref.model.mtp`; lathe.train.mtp). Whether the policy
has MTP layers is checked once it is loaded (`lathe.train.mtp.mtp_training`)."""

from __future__ import annotations

import warnings

from .errors import ProblemList

A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
KEY = f"{M}.mtp"


def check_mtp(cfg, problems: ProblemList) -> None:
    """`mtp.enable_train` needs `mtp.enable` (verl ignores it without); what the MTP update does not combine with yet
    is refused here, before any model loads. The reference and old-log-prob passes never run the MTP layers."""
    arr = cfg.actor_rollout_ref
    mtp = arr.model.mtp
    if mtp.enable_train and not mtp.enable:
        warnings.warn(f"{KEY}.enable_train=true has no effect with {KEY}.enable=false (as in verl): the MTP layers "
                      f"are loaded and saved but not trained. Set {KEY}.enable=true to train them.", stacklevel=2)
    if not (mtp.enable and mtp.enable_train):
        return
    # Ulysses composes, with tensor parallelism too (each rank trains the MTP layers on its slice: lathe.train.mtp)
    unsupported = [
        (arr.model.lora_rank > 0, f"{M}.lora_rank={arr.model.lora_rank}", "set it to 0"),
        (arr.actor.use_prefix_grouper, f"{A}.use_prefix_grouper=true", "set it to false"),
        (arr.model.impl == "hf", f"{M}.impl=hf (transformers' module)", "set it to auto or lathe")]
    for bad, what, fix in unsupported:
        if bad:
            problems.add(f"{KEY}.enable_train=true with {what}: training the MTP layers beside it is not implemented "
                         f"yet in lathe. Fix: {fix}, or set {KEY}.enable_train=false.")
