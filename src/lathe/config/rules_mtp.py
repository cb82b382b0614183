"""Cross-field rules of multi-token prediction (`actor_rollout_ref.model.mtp`): training the MTP layers (lathe.train.mtp)
and speculative decoding with them in the rollout (`enable_rollout`: lathe.engine.spec_step). Whether the policy has MTP
layers is checked once it is loaded (`lathe.train.mtp.mtp_training`, `lathe.engine.spec_step.refuse_speculative`).

`enable_rollout` reads verl's keys of the backend `rollout.name` names, as verl hands them to it: vLLM's
(`method`, `num_speculative_tokens`) for `vllm`, SGLang's (`speculative_algorithm`, `speculative_num_steps`,
`speculative_eagle_topk`, `speculative_num_draft_tokens`) for any other name (lathe's engine runs either way); the
other backend's keys are not read. lathe's engine drafts a chain of tokens with the first MTP layer and verifies them
in one forward, so it takes EAGLE/NEXTN (SGLang's names for MTP drafting) or `mtp` (vLLM's) with one draft per step
(topk 1) and num_draft_tokens = num_steps + 1; tree drafts and separate draft models are refused here."""

from __future__ import annotations

import warnings

from .errors import ProblemList

A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
KEY = f"{M}.mtp"


R = "actor_rollout_ref.rollout"
SGLANG_ALGORITHMS = ("EAGLE", "NEXTN")      # SGLang's MTP drafting (NEXTN: its alias for MTP models)


def speculative_tokens(arr) -> int:
    """Draft tokens per verify step of `model.mtp.enable_rollout` (0: no speculative decoding): vLLM's
    `num_speculative_tokens` when `rollout.name=vllm`, else SGLang's `speculative_num_steps` (module doc)."""
    mtp = arr.model.mtp
    if not (mtp.enable and mtp.enable_rollout):
        return 0
    return int(mtp.num_speculative_tokens if arr.rollout.name == "vllm" else mtp.speculative_num_steps)


def _check_rollout(cfg, problems: ProblemList) -> None:
    arr = cfg.actor_rollout_ref
    mtp, rollout = arr.model.mtp, arr.rollout
    if mtp.enable_rollout and not mtp.enable:
        warnings.warn(f"{KEY}.enable_rollout=true has no effect with {KEY}.enable=false (as in verl): the rollout "
                      f"decodes without drafts. Set {KEY}.enable=true to decode speculatively.", stacklevel=3)
        return
    if not mtp.enable_rollout:
        return
    if rollout.name == "vllm":
        if mtp.method != "mtp":
            problems.add(f"{KEY}.method={mtp.method!r} (rollout.name=vllm): lathe's engine drafts with the "
                         f"checkpoint's MTP layers only. Fix: set {KEY}.method=mtp.")
        if mtp.num_speculative_tokens < 1:
            problems.add(f"{KEY}.num_speculative_tokens={mtp.num_speculative_tokens}: must be >= 1.")
    else:
        steps, topk, draft = mtp.speculative_num_steps, mtp.speculative_eagle_topk, mtp.speculative_num_draft_tokens
        if str(mtp.speculative_algorithm).upper() not in SGLANG_ALGORITHMS:
            problems.add(f"{KEY}.speculative_algorithm={mtp.speculative_algorithm!r}: lathe's engine drafts with the "
                         f"checkpoint's MTP layers (EAGLE or NEXTN); separate draft models (EAGLE3, STANDALONE) and "
                         f"n-gram drafting are not implemented. Fix: set {KEY}.speculative_algorithm=EAGLE.")
        if steps < 1:
            problems.add(f"{KEY}.speculative_num_steps={steps}: must be >= 1.")
        if topk != 1:
            problems.add(f"{KEY}.speculative_eagle_topk={topk}: tree drafts (several candidates per step) are not "
                         f"implemented in lathe's engine, which verifies one chain. Fix: set it to 1.")
        elif draft != steps + 1:
            problems.add(f"{KEY}.speculative_num_draft_tokens={draft} with speculative_num_steps={steps} and topk 1: "
                         f"a chain verifies num_steps + 1 tokens. Fix: set it to {steps + 1}.")
    unsupported = [
        (rollout.name == "hf", f"{R}.name=hf (transformers generate)", f"set {R}.name to auto or lathe"),
        (arr.model.impl == "hf", f"{M}.impl=hf (lathe's engine needs its own decoder)", "set it to auto or lathe"),
        (bool(rollout.quantization), f"{R}.quantization={rollout.quantization}", "set it to null"),
        (rollout.kv_cache_dtype != "auto", f"{R}.kv_cache_dtype={rollout.kv_cache_dtype} (an FP8 KV cache)",
         "set it to auto"),
        (arr.model.lora_rank > 0, f"{M}.lora_rank={arr.model.lora_rank}", "set it to 0"),
        (rollout.enable_rollout_routing_replay, f"{R}.enable_rollout_routing_replay=true", "set it to false")]
    for bad, what, fix in unsupported:
        if bad:
            problems.add(f"{KEY}.enable_rollout=true with {what}: speculative decoding beside it is not implemented "
                         f"yet in lathe. Fix: {fix}, or set {KEY}.enable_rollout=false.")


def check_mtp(cfg, problems: ProblemList) -> None:
    """`mtp.enable_train` needs `mtp.enable` (verl ignores it without); what the MTP update does not combine with yet
    is refused here, before any model loads. The reference and old-log-prob passes never run the MTP layers."""
    _check_rollout(cfg, problems)
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
