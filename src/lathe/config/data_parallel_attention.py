"""verl's `rollout.data_parallel_size` (data-parallel attention, `lathe.engine.data_parallel`): where it runs, where it
runs as replicas of whole experts (lathe's `rollout.data_parallel_attention`: auto, always, never), and which sizes
cannot run. Read by the translation (`verl_translate.
engine_data_parallel`, which warns), the rules (`rules_parallel.check_rollout_tp`, which refuse) and the key's docs."""

from __future__ import annotations

from .coerce import show
from .plan import rollout_devices, trainer_devices

R = "actor_rollout_ref.rollout"
ISSUE = "lathe issue 43: model-parallel engine replicas"


def data_parallel_attention_lacks(cfg) -> str | None:
    """What of the run keeps data-parallel attention (`lathe.engine.data_parallel`) from driving its engine, or None:
    `rollout.data_parallel_attention=never`, or what it is not built for (`engine_lacks`). Such runs take verl's
    EP = TP x DP as replicas of whole experts."""
    if cfg.actor_rollout_ref.rollout.data_parallel_attention == "never":
        return f"`{R}.data_parallel_attention=never`"
    return engine_lacks(cfg)


def engine_lacks(cfg) -> str | None:
    """What of the run data-parallel attention is not built for, or None: speculative decoding verifies in steps of
    its own (its lockstep is not built), FP8 rollout quantises whole experts (`lathe.engine.llm_engine` refuses it on
    any replica of several ranks). (The agent loop runs in the replicas' lockstep, a tensor-parallel replica's
    leaders agreeing and their followers following: `lathe.workers.lockstep`; so do fully-async training's replicas,
    each stepping in a thread of its own: `lathe.workers.fully_async.RolloutWorker`.)"""
    from .rules_mtp import speculative_tokens
    arr = cfg.actor_rollout_ref
    if speculative_tokens(arr) > 0:
        return "speculative decoding (model.mtp.enable_rollout=true)"
    if arr.rollout.quantization:
        return f"FP8 rollout (rollout.quantization={arr.rollout.quantization})"
    return None


def data_parallel_verdict(cfg) -> tuple[str, str] | None:
    """verl's rollout.data_parallel_size D (vLLM/SGLang's data-parallel attention: one engine of D x TP ranks, each
    data-parallel rank with sequences of its own, the experts over all D x TP) runs as lathe's data-parallel attention
    (`lathe.engine.data_parallel`) with expert_parallel_size D x TP, else (EP 1 or TP) as D replicas of TP ranks with
    whole experts: the same samples either way, each seeded by its place in the batch. ("refuse", why) for sizes that
    cannot run (`rules_parallel.check_rollout_tp` refuses), ("warn", why) for the replicas (`verl_translate.
    engine_data_parallel` warns), None for data-parallel attention or D = 1. lathe's `data_parallel_attention`: never
    takes the replicas (warned), always is refused where data-parallel attention cannot run; auto is decided when the
    model is known (`auto_replicas`)."""
    ro = cfg.actor_rollout_ref.rollout
    value = ro.data_parallel_size
    if value in (None, 1):
        if ro.data_parallel_attention == "always":
            return "refuse", (f"`{R}.data_parallel_attention=always` with data_parallel_size={show(value)}: no "
                              "engine of several replicas to run it. Fix: set data_parallel_size to the replicas of "
                              "an engine (and expert_parallel_size to it x tensor_model_parallel_size), or remove "
                              "the key")
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
    setting, lacks = ro.data_parallel_attention, data_parallel_attention_lacks(cfg)
    if setting == "always" and (ep != value * tp or lacks is not None):
        return "refuse", (f"`{R}.data_parallel_attention=always` with {key}={value}, tensor_model_parallel_size={tp} "
                          f"and expert_parallel_size={ep}: " + (
                              f"data-parallel attention needs expert_parallel_size = {value * tp} (D x TP)"
                              if ep != value * tp else f"data-parallel attention does not run with {lacks} yet "
                                                       f"({ISSUE})") + ". Fix: set it to auto or never (replicas of "
                          "whole experts: the same samples)")
    if ep == value * tp and lacks is None:    # data-parallel attention (`lathe.engine.data_parallel`, which logs how)
        return None
    if ep == value * tp and setting == "never":
        return "warn", (f"`{key}`={value} with expert_parallel_size={ep} runs as {value} of lathe's engine replicas "
                        f"of {tp} rank(s) each, a mixture-of-experts model's experts whole over each replica's ranks "
                        f"(data_parallel_attention=never): expert_parallel_size {ep} runs as {tp}.")
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
