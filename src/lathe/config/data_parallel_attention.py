"""verl's `rollout.data_parallel_size` (data-parallel attention, `lathe.engine.data_parallel`): where it runs, where it
runs as replicas of whole experts, and which sizes cannot run. Read by the translation (`verl_translate.
engine_data_parallel`, which warns), the rules (`rules_parallel.check_rollout_tp`, which refuse) and the key's docs."""

from __future__ import annotations

from .coerce import show
from .plan import is_async, rollout_devices, trainer_devices

R = "actor_rollout_ref.rollout"
ISSUE = "lathe issue 43: model-parallel engine replicas"


def data_parallel_attention_lacks(cfg) -> str | None:
    """What of the run keeps data-parallel attention (`lathe.engine.data_parallel`) from driving its engine, or None:
    the agent loop and fully-async training stream requests step by step, speculative decoding verifies in steps of
    its own (its lockstep is not built). Such runs take verl's EP = TP x DP as replicas of whole experts."""
    from .rules_mtp import speculative_tokens
    arr = cfg.actor_rollout_ref
    if is_async(cfg):
        return "fully-async training"
    if arr.rollout.multi_turn.enable:
        return "the agent loop (multi_turn.enable=true)"
    if speculative_tokens(arr) > 0:
        return "speculative decoding (model.mtp.enable_rollout=true)"
    return None


def data_parallel_verdict(cfg) -> tuple[str, str] | None:
    """verl's rollout.data_parallel_size D (vLLM/SGLang's data-parallel attention: one engine of D x TP ranks, each
    data-parallel rank with sequences of its own, the experts over all D x TP) runs as lathe's data-parallel attention
    (`lathe.engine.data_parallel`) with expert_parallel_size D x TP, else (EP 1 or TP) as D replicas of TP ranks with
    whole experts: the same samples either way, each seeded by its place in the batch. ("refuse", why) for sizes that
    cannot run (`rules_parallel.check_rollout_tp` refuses), ("warn", why) for the replicas (`verl_translate.
    engine_data_parallel` warns), None for data-parallel attention or D = 1."""
    ro = cfg.actor_rollout_ref.rollout
    value = ro.data_parallel_size
    if value in (None, 1):
        return None
    tp, ep, key = ro.tensor_model_parallel_size, ro.expert_parallel_size, f"{R}.data_parallel_size"
    devices = rollout_devices(cfg) or trainer_devices(cfg)         # a rollout pool's own, else the trainer's
    if value < 1 or devices % (value * tp) or ep not in (None, 1, tp, value * tp):
        return "refuse", (f"`{key}`={show(value)} with tensor_model_parallel_size={tp} and expert_parallel_size="
                          f"{ep}: an engine of data_parallel_size x tensor_model_parallel_size = {value * tp} ranks "
                          f"({value} replicas of {tp} rank(s); {ISSUE}) needs {value * tp} to divide the "
                          f"{devices} rollout devices and expert_parallel_size to be {value * tp} (data-parallel "
                          f"attention: verl's EP = TP x DP), {tp} or 1 (replicas of whole experts). Fix: set "
                          "data_parallel_size to 1 (or such a size).")
    lacks = data_parallel_attention_lacks(cfg)
    if ep == value * tp and lacks is None:    # data-parallel attention (`lathe.engine.data_parallel`, which logs how)
        return None
    if ep == value * tp:
        return "warn", (f"`{key}`={value} with expert_parallel_size={ep} (data-parallel attention) runs with {lacks} "
                        f"as {value} of lathe's engine replicas of {tp} rank(s) each, a mixture-of-experts model's "
                        f"experts whole over each replica's ranks (expert_parallel_size {ep} runs as {tp}): the same "
                        f"samples, {value} times the experts per rank (data-parallel attention does not run with "
                        f"{lacks} yet).")
    return "warn", (f"`{key}`={value} with expert_parallel_size={ep} runs as {value} of lathe's engine replicas of "
                    f"{tp} rank(s) each, a mixture-of-experts model's experts whole over each replica's ranks: the "
                    f"same samples (data-parallel attention, its experts over all {value * tp} ranks, takes "
                    f"expert_parallel_size={value * tp}).")
