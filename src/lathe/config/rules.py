"""Cross-field rules checked by ``load_config`` before any model loads.

Every message spells out verl's batch semantics with the numbers (see `lathe.config.plan`, which derives the
batch cut these rules check).
"""

from __future__ import annotations

import os
import re
import sys
import warnings

from .distill import check_distillation
from .errors import ProblemList
from .judge import check_judge
from .plan import (BatchPlan, Devices, batch_plan, critic_in_use, is_async, mesh_problems, reward_devices,
                   sequence_parallel_size, teacher_devices)
from .profiler import check_profiler
from .rules_agent import check_custom_agent_loops
from .rules_attention import check_attention
from .rules_fp8 import check_fp8_reference, check_fp8_training
from .rules_recompute import check_recompute
from .rules_reward import check_reward_manager
from .rules_mtp import check_mtp
from .rules_optim import check_optimizers
from .rules_pf_ppo import check_pf_ppo
from .rules_routing import check_routing_replay
from .rules_v1 import check_v1
from .rules_parallel import (KEYS as SP_KEYS, check_expert_parallel, check_keep_gathered, check_rollout_tp,
                             check_sequence_parallel, check_tensor_parallel, data_parallel)
from .schema import LatheConfig


def cuda_available() -> bool:
    """Whether CUDA looks usable, without importing torch (uses torch only if already imported)."""
    return visible_cuda_devices() > 0


def visible_cuda_devices() -> int:
    """How many CUDA devices this process can see, without importing torch (uses torch if already imported).

    ``CUDA_VISIBLE_DEVICES`` wins when set (its entries counted, capped by the GPUs present); else the
    driver's GPU list under /proc, else the /dev/nvidiaN nodes.
    """
    if "torch" in sys.modules:
        cuda = sys.modules["torch"].cuda
        return int(cuda.device_count()) if cuda.is_available() else 0
    present = _gpus_present()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    entries = [e for e in visible.split(",") if e.strip()]
    if not entries or entries[0].strip() == "-1":
        return 0
    return min(len(entries), present)


def _gpus_present() -> int:
    """NVIDIA GPUs the driver exposes (0 without a driver)."""
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    if not os.path.exists("/dev/nvidiactl"):
        return 0
    return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name)) or 1


def check_visible_devices(cfg: LatheConfig, problems: ProblemList) -> None:
    """A GPU run may not ask for more GPUs per node than this process can see: on one node, the trainer's, the
    rollout pool's (fully async), the reward model's pool's (`reward_model.enable_resource_pool`) and the teachers'
    pool's (`distillation.nnodes` x `n_gpus_per_node`) together."""
    t, rm, d = cfg.trainer, cfg.reward_model, cfg.distillation
    visible = visible_cuda_devices()
    if t.device == "cpu" or (t.device == "auto" and visible == 0):
        return
    pools = [("trainer", "the trainer", t.nnodes, t.n_gpus_per_node)]
    if is_async(cfg):
        pools.append(("rollout", "the rollout", cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node))
    if reward_devices(cfg):
        pools.append(("reward_model", "the reward model", rm.nnodes, rm.n_gpus_per_node))
    if teacher_devices(cfg):
        pools.append(("distillation", "the teachers", d.nnodes, d.n_gpus_per_node))
    if len(pools) > 1 and all(nodes == 1 for _, _, nodes, _ in pools) and sum(p[3] for p in pools) > visible:
        asked = " + ".join(f"{key}.n_gpus_per_node={n}" for key, _, _, n in pools)
        owners = " and ".join([", ".join(p[1] for p in pools[:-1]), pools[-1][1]])
        problems.add(f"{asked} GPUs on this one node, but this process sees {visible}. Fix: lower one of them "
                     f"({owners} each need devices of their own), or add nodes "
                     f"({'/'.join(f'{key}.nnodes' for key, _, _, _ in pools)}).")
        return
    if t.n_gpus_per_node <= visible:
        return
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
    problems.add(f"trainer.device={t.device} with trainer.n_gpus_per_node={t.n_gpus_per_node} asks for "
                 f"{t.n_gpus_per_node} GPU(s), but this process sees {visible}{where}. Fix: make the GPUs visible, "
                 f"or set trainer.device=cpu (or auto, which trains on the CPU when no GPU is visible).")


def check_config(cfg: LatheConfig, devices: Devices, problems: ProblemList) -> None:
    """Add every cross-field violation to ``problems``; emit warnings for allowed-but-odd combos."""
    arr = cfg.actor_rollout_ref
    actor_ok = _check_batches(cfg, "actor_rollout_ref.actor", arr.actor, devices, problems)
    if critic_in_use(cfg):
        if cfg.critic.ppo_mini_batch_size != arr.actor.ppo_mini_batch_size:
            _check_batches(cfg, "critic", cfg.critic, devices, problems)
        elif actor_ok:  # same mini-batch as the actor: only the critic's own micro-batch is new
            _check_micro("critic", cfg.critic, batch_plan(cfg, devices.count, "critic"), arr.rollout.n, problems)
        _check_critic_lora(cfg, problems)
    for message in mesh_problems(cfg, devices):      # fsdp_size must divide the devices (HSDP)
        problems.add(message)
    check_sequence_parallel(cfg, devices, problems)
    check_tensor_parallel(cfg, devices, problems)
    check_expert_parallel(cfg, problems)
    check_keep_gathered(cfg, problems)
    _check_ranges(cfg, problems)
    _check_backend_and_run(cfg, problems)
    _check_algorithm_keys(cfg, problems)
    check_pf_ppo(cfg, problems)
    _check_reward_model(cfg, problems)
    check_reward_manager(cfg, problems)
    check_distillation(cfg, problems)
    check_routing_replay(cfg, problems)
    check_mtp(cfg, problems)
    check_fp8_training(cfg, problems)
    check_fp8_reference(cfg, problems)
    check_recompute(cfg, problems)
    check_attention(cfg, problems)
    check_optimizers(cfg, problems)
    if arr.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        warnings.warn("actor_rollout_ref.actor.use_kl_loss=true and algorithm.use_kl_in_reward=true: the KL to "
                      "the reference policy is applied twice (as a loss term and as a reward penalty). verl "
                      "allows this, but usually only one is wanted (GRPO: use_kl_loss).", UserWarning, stacklevel=3)


def _check_critic_lora(cfg: LatheConfig, problems: ProblemList) -> None:
    """LoRA for the critic runs on lathe's value model (`lathe.workers.critic`), as the actor's on lathe's decoder."""
    rank, impl = cfg.critic.model.lora_rank, cfg.actor_rollout_ref.model.impl
    if rank > 0 and impl == "hf":
        problems.add(f"critic.model.lora_rank={rank} with actor_rollout_ref.model.impl=hf: lathe's LoRA adapts lathe's "
                     "value model, not a transformers one. Fix: set actor_rollout_ref.model.impl=auto (or lathe), or "
                     "critic.model.lora_rank=0.")


OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


def _check_algorithm_keys(cfg: LatheConfig, problems: ProblemList) -> None:
    """The keys an advantage estimator or policy loss cannot run without (GDPO, OTB, DRO)."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    a = "actor_rollout_ref.actor"
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        problems.add("algorithm.adv_estimator=gdpo normalises each reward component separately, but "
                     "algorithm.gdpo_reward_keys names none. Fix: list the keys of the dict your reward function "
                     "returns, e.g. +algorithm.gdpo_reward_keys='[accuracy_reward, format_reward]'.")
    weights = algo.gdpo_reward_weights
    if weights is not None and len(weights) != len(algo.gdpo_reward_keys or []):
        problems.add(f"algorithm.gdpo_reward_weights={weights} has {len(weights)} weights for "
                     f"{len(algo.gdpo_reward_keys or [])} algorithm.gdpo_reward_keys. Fix: give one weight per key, "
                     "or remove gdpo_reward_weights for equal weights.")
    if algo.adv_estimator in OTB_ESTIMATORS and not actor.calculate_sum_pi_squared:
        problems.add(f"algorithm.adv_estimator={algo.adv_estimator} weighs tokens by sum_v pi(v)^2 from the "
                     f"old-log-prob pass, which {a}.calculate_sum_pi_squared=false does not compute. Fix: set "
                     f"{a}.calculate_sum_pi_squared=true.")
    beta = actor.policy_loss.dro_beta
    if actor.policy_loss.loss_mode == "dro" and (beta is None or beta <= 0):
        problems.add(f"{a}.policy_loss.loss_mode=dro needs {a}.policy_loss.dro_beta > 0 (the weight of its quadratic "
                     f"log-ratio penalty), got {beta}. Fix: set it, e.g. {a}.policy_loss.dro_beta=0.1.")


def _check_reward_model(cfg: LatheConfig, problems: ProblemList) -> None:
    """A learned reward model (`reward_model.enable`) needs its checkpoint and a way to cut its forwards."""
    rm = cfg.reward_model
    check_judge(cfg, problems)
    if rm.enable and rm.enable_resource_pool:
        for key, value in (("n_gpus_per_node", rm.n_gpus_per_node), ("nnodes", rm.nnodes)):
            if value < 1:
                problems.add(f"reward_model.{key}={value} with reward_model.enable_resource_pool=true: the reward "
                             f"model's own pool is reward_model.nnodes x reward_model.n_gpus_per_node devices (one "
                             f"whole copy on each), so both must be >= 1. Fix: set reward_model.{key} to 1 or more, "
                             "or remove enable_resource_pool (the reward model then shares the trainer's devices).")
    if not rm.enable or rm.judge.enable:
        return
    if not rm.model.path:
        problems.add("reward_model.enable=true needs reward_model.model.path, which is not set. Fix: set it to a "
                     "sequence-classification checkpoint (one label), or set reward_model.enable=false.")
    if rm.max_length is not None and rm.max_length < 1:
        problems.add(f"reward_model.max_length={rm.max_length} must be >= 1 (or null: the policy's sequence length).")
    if rm.overlong_buffer.enable:
        problems.add("reward_model.overlong_buffer.enable=true with reward_model.enable=true: verl's DAPO manager "
                     "returns the reward model's scores without the overlong penalty. Fix: set one of them to false.")
    longest = rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    if rm.use_dynamic_bsz:
        budget = rm.forward_max_token_len_per_gpu
        if budget is None or budget < longest:
            problems.add(f"reward_model.forward_max_token_len_per_gpu={budget} must hold the longest reward-model "
                         f"input, {longest} tokens (reward_model.max_length, else data.max_prompt_length + "
                         "max_response_length) with reward_model.use_dynamic_bsz. Fix: raise it.")
    elif rm.micro_batch_size_per_gpu is not None and rm.micro_batch_size_per_gpu < 1:
        problems.add(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu}: a reward model scores "
                     "in micro-batches of this many rows per device. Fix: set it to 1 or more (or null: the "
                     "policy's log-prob micro-batch).")


def _suggest(values: list[int], target: int) -> str:
    """'e.g. 4 or 8': up to two valid values nearest ``target``."""
    best = sorted(set(values), key=lambda v: (abs(v - target), v))[:2]
    return "e.g. " + " or ".join(str(v) for v in sorted(best)) if best else "no valid value exists"


def _check_batches(cfg: LatheConfig, prefix: str, owner, devices: Devices, problems: ProblemList) -> bool:
    """Rules 1-4 for one role; returns whether the mini-batch rules held (micro is checked only then)."""
    tbs, n, mini = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, owner.ppo_mini_batch_size
    key = f"{prefix}.ppo_mini_batch_size"
    if not _positive([("data.train_batch_size", tbs), ("actor_rollout_ref.rollout.n", n), (key, mini)], problems):
        return False
    role = "actor" if prefix == "actor_rollout_ref.actor" else "critic"
    if not _check_mini(cfg, key, tbs, n, mini, data_parallel(cfg, role, devices), problems):
        return False
    _check_micro(prefix, owner, batch_plan(cfg, devices.count, role), n, problems)
    return True


def _positive(items: list[tuple[str, int]], problems: ProblemList) -> bool:
    """Rule 1: batch sizes and n are >= 1."""
    bad = [(k, v) for k, v in items if v < 1]
    for k, v in bad:
        problems.add(f"{k}={v} must be >= 1 (train_batch_size = prompts per step, n = responses per prompt, "
                     f"ppo_mini_batch_size = prompts per PPO update). Fix: set {k} to a positive number.")
    return not bad


def _check_mini(cfg: LatheConfig, key: str, tbs: int, n: int, mini: int, devices: Devices,
                problems: ProblemList) -> bool:
    """Rules 2-3: the mini-batch fits in and divides the step; where its sequences do not divide over the
    data-parallel ranks, ghost rows pad each rank's share (`lathe.cluster.dispatch`), with a notice; beside MoE router
    losses their tokens are left out of the router statistics (`lathe.train.router_tokens`), except under the prefix
    grouper, whose shared-prompt forward does not tell them apart."""
    divisors = [d for d in range(1, tbs + 1) if tbs % d == 0]
    if mini > tbs:
        problems.add(f"{key}={mini} is larger than data.train_batch_size={tbs}. A PPO mini-batch is a slice of "
                     f"one step's {tbs} prompts, so it cannot hold more. Fix: set ppo_mini_batch_size to a "
                     f"divisor of {tbs}, {_suggest(divisors, mini)}, or raise data.train_batch_size.")
        return False
    ok = True
    if tbs % mini:
        ok = False
        problems.add(f"{key}={mini} does not divide data.train_batch_size={tbs}. Each step's {tbs} prompts are "
                     f"split into mini-batches of {mini} prompts (x rollout.n={n} = {mini * n} sequences) for "
                     f"the PPO updates, so {tbs} must be a multiple of {mini}. Fix: set ppo_mini_batch_size to "
                     f"a divisor of {tbs}, {_suggest(divisors, mini)}.")
    if (mini * n) % devices.count:
        fits = [d for d in divisors if (d * n) % devices.count == 0]
        router = _router_losses(cfg) if key.startswith("actor_rollout_ref.") else None
        if router and cfg.actor_rollout_ref.actor.use_prefix_grouper:
            ok = False
            problems.add(f"{key}={mini} x actor_rollout_ref.rollout.n={n} = {mini * n} sequences per mini-batch is "
                         f"not divisible by the device count ({devices.why}), so ghost rows would pad the ranks' "
                         f"shares, and with {router} and actor_rollout_ref.actor.use_prefix_grouper=true their "
                         "tokens would enter the router statistics (the prefix-grouped forward shares a ghost row's "
                         "prompt with its real twin). Fix: set use_prefix_grouper=false, or ppo_mini_batch_size so "
                         f"that ppo_mini_batch_size x n is a multiple of {devices.count}, {_suggest(fits, mini)}.")
        else:
            per_rank = -(-mini * n // devices.count)
            warnings.warn(f"{key}={mini} x actor_rollout_ref.rollout.n={n} = {mini * n} sequences per mini-batch do "
                          f"not divide over the {devices.count} data-parallel ranks ({devices.why}): each rank gets "
                          f"{per_rank}, {per_rank * devices.count - mini * n} of them ghost rows (copies of the "
                          "shortest sequence that add no loss and count for nothing; their forward and backward are "
                          "wasted work). " + (f"ppo_mini_batch_size {_suggest(fits, mini)} divides evenly." if fits
                                              else "No divisor of data.train_batch_size divides evenly."),
                          UserWarning, stacklevel=4)
    return ok


def _router_losses(cfg: LatheConfig) -> str | None:
    """The actor's MoE router loss that is on (its key), else None."""
    actor = cfg.actor_rollout_ref.actor
    if cfg.actor_rollout_ref.model.override_config.get("output_router_logits"):
        return "actor_rollout_ref.model.override_config.output_router_logits=true"
    if actor.moe_aux_loss_coeff:
        return f"actor_rollout_ref.actor.moe_aux_loss_coeff={actor.moe_aux_loss_coeff}"
    if actor.moe_z_loss_coeff:
        return f"actor_rollout_ref.actor.moe_z_loss_coeff={actor.moe_z_loss_coeff}"
    return None


def _check_micro(prefix: str, owner, plan: BatchPlan, n: int, problems: ProblemList) -> None:
    """Rule 4: the per-device micro-batch divides the per-device mini-batch."""
    micro = owner.ppo_micro_batch_size_per_gpu
    if micro is None or owner.use_dynamic_bsz:
        return
    per_device, key = plan.mini_batch_sequences_per_device, f"{prefix}.ppo_micro_batch_size_per_gpu"
    shares = (f"{plan.device_count} device(s)" if plan.group_size == 1 else
              f"{plan.data_parallel_size} data-parallel group(s) of {plan.group_size} devices")
    where = (f"the per-device mini-batch of {per_device} sequences (ppo_mini_batch_size={plan.mini_batch_prompts} "
             f"x rollout.n={n} / {shares})")
    divisors = [d for d in range(1, per_device + 1) if per_device % d == 0]
    if micro < 1:
        problems.add(f"{key}={micro} must be between 1 and {where}, because a micro-batch is a slice of it. "
                     f"Fix: set it to a divisor of {per_device}, {_suggest(divisors, micro)}, or leave it null "
                     f"(one pass over the whole per-device mini-batch).")
    elif micro > per_device:        # verl too cuts a rank's share into one micro-batch then
        warnings.warn(f"{key}={micro} is more than {where}: each device runs its share as one micro-batch of "
                      f"{per_device}.", UserWarning, stacklevel=4)
    elif per_device % micro:
        problems.add(f"{key}={micro} does not divide {where}; gradient accumulation needs equal micro-batches. "
                     f"Fix: set it to a divisor of {per_device}, {_suggest(divisors, micro)}.")


def _range_rules(cfg: LatheConfig) -> list[tuple[str, object, bool, str]]:
    """(key, value, ok, rule) for the simple per-key range checks (rule 7 and friends)."""
    arr, data, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    actor, ro, vk = arr.actor, arr.rollout, arr.rollout.val_kwargs
    a = "actor_rollout_ref.actor"
    r = "actor_rollout_ref.rollout"
    rules = [(f"{a}.{k}", getattr(actor, k), getattr(actor, k) >= 0, "must be >= 0 (a clip epsilon)")
             for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")]
    rules += [
        (f"{a}.clip_ratio_c", actor.clip_ratio_c, actor.clip_ratio_c > 1, "must be > 1 (dual-clip constant)"),
        (f"{r}.temperature", ro.temperature, ro.temperature > 0, "must be > 0 (use do_sample=false for greedy)"),
        (f"{r}.val_kwargs.temperature", vk.temperature, vk.temperature >= 0, "must be >= 0 (0 = greedy)"),
        (f"{r}.top_p", ro.top_p, 0 < ro.top_p <= 1, "must be in (0, 1]"),
        (f"{r}.val_kwargs.top_p", vk.top_p, 0 < vk.top_p <= 1, "must be in (0, 1]"),
        (f"{r}.top_k", ro.top_k, ro.top_k == -1 or ro.top_k >= 1, "must be -1 (disabled) or >= 1"),
        (f"{r}.val_kwargs.top_k", vk.top_k, vk.top_k == -1 or vk.top_k >= 1, "must be -1 (disabled) or >= 1"),
        (f"{r}.val_kwargs.n", vk.n, vk.n >= 1, "must be >= 1"),
        (f"{r}.gpu_memory_utilization", ro.gpu_memory_utilization, 0 < ro.gpu_memory_utilization <= 1,
         "must be in (0, 1] (a fraction of device memory)"),
        (f"{r}.standalone_gpu_memory_utilization", ro.standalone_gpu_memory_utilization,
         ro.standalone_gpu_memory_utilization is None or 0 < ro.standalone_gpu_memory_utilization <= 1,
         "must be in (0, 1] (a fraction of device memory) or null"),
        ("data.max_prompt_length", data.max_prompt_length, data.max_prompt_length >= 1, "must be >= 1"),
        ("data.max_response_length", data.max_response_length, data.max_response_length >= 1, "must be >= 1"),
        ("data.gen_batch_size", data.gen_batch_size, data.gen_batch_size >= 1, "must be >= 1 (prompts per round)"),
        (f"{r}.prompt_length", ro.prompt_length, ro.prompt_length >= 1, "must be >= 1"),
        (f"{r}.response_length", ro.response_length, ro.response_length >= 1, "must be >= 1"),
        (f"{a}.optim.lr", actor.optim.lr, actor.optim.lr >= 0, "must be >= 0"),
        ("critic.optim.lr", cfg.critic.optim.lr, cfg.critic.optim.lr >= 0, "must be >= 0"),
        ("actor_rollout_ref.model.warm_start.lr", arr.model.warm_start.lr, arr.model.warm_start.lr >= 0,
         "must be >= 0"),
        ("actor_rollout_ref.model.warm_start.steps", arr.model.warm_start.steps, arr.model.warm_start.steps >= 0,
         "must be >= 0 (0 = no warm start)"),
        (f"{a}.optim.betas", actor.optim.betas, _betas_ok(actor.optim.betas), "must be two numbers in [0, 1)"),
        ("critic.optim.betas", cfg.critic.optim.betas, _betas_ok(cfg.critic.optim.betas),
         "must be two numbers in [0, 1)"),
        (f"{a}.ppo_epochs", actor.ppo_epochs, actor.ppo_epochs >= 1, "must be >= 1"),
        ("critic.ppo_epochs", cfg.critic.ppo_epochs, cfg.critic.ppo_epochs >= 1, "must be >= 1"),
        *[(_grad_clip_key(prefix, owner), owner.grad_clip, owner.grad_clip > 0, "must be > 0 (max gradient norm)")
          for prefix, owner in ((a, actor), ("critic", cfg.critic))],
        ("algorithm.gamma", cfg.algorithm.gamma, 0 <= cfg.algorithm.gamma <= 1, "must be in [0, 1]"),
        ("algorithm.lam", cfg.algorithm.lam, 0 <= cfg.algorithm.lam <= 1, "must be in [0, 1]"),
        ("reward.timeout_s", cfg.reward.timeout_s, cfg.reward.timeout_s >= 0, "must be >= 0 (0 = no timeout)"),
        ("reward.num_workers", cfg.reward.num_workers, cfg.reward.num_workers >= 1, "must be >= 1"),
        ("reward.max_failure_fraction", cfg.reward.max_failure_fraction,
         0 <= cfg.reward.max_failure_fraction < 1, "must be in [0, 1)"),
        ("trainer.restart_on_worker_failure", cfg.trainer.restart_on_worker_failure,
         cfg.trainer.restart_on_worker_failure >= 0, "must be >= 0"),
        ("trainer.max_nonfinite_updates", cfg.trainer.max_nonfinite_updates, cfg.trainer.max_nonfinite_updates >= 0,
         "must be >= 0"),
        ("reward.max_failing_calls", cfg.reward.max_failing_calls, cfg.reward.max_failing_calls >= 0, "must be >= 0"),
        ("trainer.nnodes", t.nnodes, t.nnodes >= 1, "must be >= 1"),
        ("trainer.n_gpus_per_node", t.n_gpus_per_node, t.n_gpus_per_node >= 1, "must be >= 1"),
        ("trainer.total_epochs", t.total_epochs, t.total_epochs >= 1, "must be >= 1"),
        ("trainer.total_training_steps", t.total_training_steps,
         t.total_training_steps is None or t.total_training_steps >= 1, "must be >= 1 or null"),
    ]
    return rules + _token_budget_rules(cfg)


def _token_budget_rules(cfg: LatheConfig) -> list[tuple[str, object, bool, str]]:
    """With use_dynamic_bsz, each token budget in force must hold the longest sequence (prompt + response); with
    Ulysses sequence parallelism a micro-batch holds the budget x the role's ulysses_sequence_parallel_size (verl's
    rule: the group's devices share each micro-batch)."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    budgets = [("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu,
                arr.actor.use_dynamic_bsz, "actor"),
               ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", arr.rollout.log_prob_max_token_len_per_gpu,
                arr.rollout.log_prob_use_dynamic_bsz, "actor"),
               ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_max_token_len_per_gpu,
                arr.ref.log_prob_use_dynamic_bsz, "ref")]
    if critic_in_use(cfg):
        budgets += [("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu, critic.use_dynamic_bsz,
                     "critic"),
                    ("critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
                     critic.use_dynamic_bsz, "critic")]
    out = []
    for key, value, on, role in budgets:
        size = max(1, sequence_parallel_size(cfg, role))
        times = "" if size == 1 else f"times {SP_KEYS[role]}={size} "
        rule = (f"{times}must be >= data.max_prompt_length + data.max_response_length = {longest} with "
                "use_dynamic_bsz (a micro-batch must hold the longest sequence)")
        if on:
            out.append((key, value, value is not None and value * size >= longest, rule))
    return out


def _betas_ok(betas: list[float]) -> bool:
    """Two Adam betas, each in [0, 1)."""
    return len(betas) == 2 and all(0 <= b < 1 for b in betas)


def _grad_clip_key(prefix: str, owner) -> str:
    """The key a user set the gradient clip with: verl's older optim.clip_grad is copied to grad_clip."""
    if owner.optim.clip_grad is not None:
        return f"{prefix}.optim.clip_grad (copied to {prefix}.grad_clip)"
    return f"{prefix}.grad_clip"


def _check_ranges(cfg: LatheConfig, problems: ProblemList) -> None:
    """Rule 7: each value within its valid range."""
    for key, value, ok, rule in _range_rules(cfg):
        if not ok:
            problems.add(f"{key}={value} is out of range: it {rule}. Fix: set {key} to a value that does.")


def _check_backend_and_run(cfg: LatheConfig, problems: ProblemList) -> None:
    """Rules 9-11: rollout backend shipped and runnable, resume path present, validation data present."""
    t = cfg.trainer
    _check_rollout_backend(cfg, problems)
    check_rollout_tp(cfg, problems)
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        problems.add("trainer.resume_mode=resume_path needs trainer.resume_from_path, which is not set. Fix: set "
                     "trainer.resume_from_path=<checkpoint dir>, or use trainer.resume_mode=auto.")
    _check_lengths_and_rounds(cfg, problems)
    _check_async(cfg, problems)
    _check_multi_turn(cfg, problems)
    check_custom_agent_loops(cfg, problems)
    check_v1(cfg, problems)                     # verl V1's trainer modes (lathe.config.rules_v1)
    check_profiler(cfg, problems)
    _check_custom_dataset(cfg, problems)
    if t.test_freq > 0 and not cfg.data.val_files:
        problems.add(f"trainer.test_freq={t.test_freq} asks for validation every {t.test_freq} steps, but "
                     f"data.val_files is not set. Fix: set data.val_files=<parquet/jsonl file> (or "
                     f"builtin:arithmetic), or set trainer.test_freq=-1.")


def _check_custom_dataset(cfg: LatheConfig, problems: ProblemList) -> None:
    """`data.custom_cls`: a file and a class name, both or neither (lathe.data.custom)."""
    c = cfg.data.custom_cls
    if bool(c.path) != bool(c.name):
        given, unset = ("path", "name") if c.path else ("name", "path")
        problems.add(f"data.custom_cls.{given}={getattr(c, given)} is set but data.custom_cls.{unset} is not: a custom "
                     "dataset class is found by its file (path) and its class name (name). Fix: set both, or neither.")


def _check_multi_turn(cfg: LatheConfig, problems: ProblemList) -> None:
    """The agent loop's settings (its format and truncation side are choices the schema checks): positive limits,
    a backend that runs it, the tool and interaction files."""
    mt, k = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:
        return
    for key in ("max_assistant_turns", "max_user_turns"):
        if getattr(mt, key) is not None and getattr(mt, key) < 1:
            problems.add(f"{k}.{key}={getattr(mt, key)}. Fix: set it to 1 or more, or to null for no cap.")
    if cfg.actor_rollout_ref.rollout.name == "hf":
        problems.add(f"{k}.enable=true with actor_rollout_ref.rollout.name=hf: the agent loop streams each turn into "
                     f"lathe's engine and is not implemented for transformers generate. Fix: set "
                     f"actor_rollout_ref.rollout.name=lathe (or auto), or {k}.enable=false.")
    for key in ("max_parallel_calls", "max_concurrent_tool_calls", "max_tool_response_length", "tool_timeout"):
        if getattr(mt, key) <= 0:
            problems.add(f"{k}.{key}={getattr(mt, key)} must be positive. Fix: raise it.")
    path = mt.tool_config_path or cfg.data.tool_config_path
    if path and not path.startswith("builtin:") and not os.path.isfile(os.path.expanduser(path)):
        problems.add(f"{k}.tool_config_path={path!r}: no such file. Fix: point it at a tool YAML file (verl's shape: "
                     f"tools: [{{class_name, config, tool_schema}}]) or a built-in one (builtin:secret_lookup), or "
                     f"remove it to run without tools.")
    path = mt.function_tool_path
    if path and not os.path.isfile(os.path.expanduser(path)):
        problems.add(f"{k}.function_tool_path={path!r}: no such file. Fix: point it at a Python file of "
                     f"@function_tool functions (from lathe.rollout.agent.function_tools import function_tool), or "
                     f"remove it.")
    path = mt.interaction_config_path
    if path and not os.path.isfile(os.path.expanduser(path)):
        problems.add(f"{k}.interaction_config_path={path!r}: no such file. Fix: point it at an interaction YAML file "
                     f"(verl's shape: interaction: [{{name, class_name, config}}]), or remove it.")


def _check_lengths_and_rounds(cfg: LatheConfig, problems: ProblemList) -> None:
    """The rollout generates data.max_response_length tokens; gen_batch_size sizes DAPO's generation rounds only."""
    d, ro, r = cfg.data, cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    for key, value, data_key, data_value in ((f"{r}.prompt_length", ro.prompt_length, "data.max_prompt_length",
                                              d.max_prompt_length),
                                             (f"{r}.response_length", ro.response_length, "data.max_response_length",
                                              d.max_response_length)):
        if value != data_value:
            problems.add(f"{key}={value} differs from {data_key}={data_value}; lathe sizes prompts and responses by "
                         f"{data_key} (verl copies it into {key}). Fix: set {data_key}={value} and leave {key} unset.")
    if d.gen_batch_size != d.train_batch_size and not cfg.algorithm.filter_groups.enable and not is_async(cfg):
        problems.add(f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size}, "
                     "but gen_batch_size is read only by DAPO's dynamic sampling (prompts per generation round, with "
                     "algorithm.filter_groups.enable=true). Fix: remove data.gen_batch_size, or set "
                     "algorithm.filter_groups.enable=true.")


def _check_async(cfg: LatheConfig, problems: ProblemList) -> None:
    """The fully-async keys: sane values, a step the prompt chunks divide, and no key of the other mode."""
    at, pool, ce = cfg.async_training, cfg.rollout, cfg.actor_rollout_ref.rollout.checkpoint_engine.backend
    if not is_async(cfg):
        if ce == "nccl":
            problems.add("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl moves weights to a separate "
                         "rollout pool, but the rollout shares the trainer's devices (rollout.n_gpus_per_node=0). "
                         "Fix: set rollout.n_gpus_per_node (fully asynchronous training), or use backend=naive/auto.")
        return
    step = cfg.data.train_batch_size
    for key, value, ok in (("async_training.staleness_threshold", at.staleness_threshold, at.staleness_threshold >= 0),
                           ("async_training.trigger_parameter_sync_step", at.trigger_parameter_sync_step,
                            at.trigger_parameter_sync_step >= 1),
                           ("async_training.require_batches", at.require_batches, at.require_batches >= 1),
                           ("rollout.nnodes", pool.nnodes, pool.nnodes >= 1),
                           ("data.gen_batch_size", cfg.data.gen_batch_size, cfg.data.gen_batch_size >= 1)):
        if not ok:
            problems.add(f"{key}={value} is out of range (staleness_threshold >= 0, the others >= 1).")
    if cfg.data.gen_batch_size >= 1 and step % cfg.data.gen_batch_size:
        problems.add(f"data.gen_batch_size={cfg.data.gen_batch_size} prompts per rollout request must divide a "
                     f"training step of async_training.require_batches x ppo_mini_batch_size = {step} prompts. "
                     "Fix: set data.gen_batch_size=1 (verl's streaming default) or a divisor of that"
                     + (" (with algorithm.filter_groups.enable=true a request is one generation round, so a DAPO "
                        "script's gen_batch_size larger than a step does not fit)"
                        if cfg.algorithm.filter_groups.enable else "") + ".")
    if ce == "naive":
        problems.add("actor_rollout_ref.rollout.checkpoint_engine.backend=naive copies weights in-process, but the "
                     "rollout has devices of its own (rollout.n_gpus_per_node > 0). Fix: use backend=nccl or auto.")
    rc = cfg.algorithm.rollout_correction
    if ((rc.rollout_is is not None or rc.rollout_rs is not None) and not rc.bypass_mode
            and at.use_rollout_log_probs and not at.compute_prox_log_prob):
        problems.add("algorithm.rollout_correction corrects between the rollout's log-probs and the trainer's "
                     "recomputed ones (decoupled mode), but async_training.use_rollout_log_probs=true without "
                     "compute_prox_log_prob takes the rollout's as PPO's old log-probs: nothing would be corrected. "
                     "Fix: set async_training.compute_prox_log_prob=true, or use a bypass preset "
                     "(algorithm.rollout_correction.bypass_mode=true).")


def _check_rollout_backend(cfg: LatheConfig, problems: ProblemList) -> None:
    """Rule 9: a shipped backend that can run this actor, a max_model_len that fits."""
    arr = cfg.actor_rollout_ref
    ro, impl = arr.rollout, arr.model.impl
    r, m = "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    if ro.name == "lathe" and impl == "hf":
        problems.add(f"{r}.name=lathe runs the policy in lathe's own decoder, but {m}.impl=hf asks for the "
                     f"transformers implementation. Fix: set {m}.impl=auto (or lathe), or set {r}.name=hf "
                     f"(or auto) to generate with transformers.")
    if ro.quantization not in (None, "fp8"):
        problems.add(f"{r}.quantization={ro.quantization!r}: lathe's engine quantises to fp8 only (other schemes, "
                     "torchao's and block scales are lathe issue 48). Fix: set it to fp8 or null.")
    if ro.quantize_lm_head and ro.quantization != "fp8":
        problems.add(f"{r}.quantize_lm_head=true puts the lm_head in FP8 beside FP8 projections, but "
                     f"{r}.quantization={ro.quantization or 'null'}. Fix: set {r}.quantization=fp8, or "
                     "quantize_lm_head=false.")
    if ro.kv_cache_dtype != "auto" and (ro.name == "hf" or impl == "hf"):
        problems.add(f"{r}.kv_cache_dtype={ro.kv_cache_dtype} is lathe's engine's FP8 KV cache, but the rollout runs "
                     f"transformers generate ({r}.name={ro.name}, {m}.impl={impl}). Fix: set {r}.kv_cache_dtype=auto "
                     f"(and no engine_kwargs kv_cache_dtype), or use lathe's engine ({r}.name=lathe and "
                     f"{m}.impl=auto).")
    if ro.quantization and (ro.name == "hf" or impl == "hf"):
        problems.add(f"{r}.quantization={ro.quantization} quantises lathe's engine, but the rollout runs "
                     f"transformers generate ({r}.name={ro.name}, {m}.impl={impl}). Fix: set {r}.quantization=null, "
                     f"or use lathe's engine ({r}.name=lathe and {m}.impl=auto).")
    if ro.quantization and ro.tensor_model_parallel_size > 1:
        problems.add(f"{r}.quantization={ro.quantization} with {r}.tensor_model_parallel_size="
                     f"{ro.tensor_model_parallel_size}: FP8 tensor-parallel replicas are not implemented yet. Fix: set "
                     f"{r}.quantization=null, or tensor_model_parallel_size=1.")
    if ro.prompt_length >= 1 and ro.response_length >= 1 and ro.max_model_len < ro.prompt_length + ro.response_length:
        problems.add(f"{r}.max_model_len={ro.max_model_len} is shorter than {r}.prompt_length={ro.prompt_length} + "
                     f"{r}.response_length={ro.response_length} = {ro.prompt_length + ro.response_length} tokens, so "
                     f"long prompts could not get their full response. Fix: raise max_model_len to at least "
                     f"{ro.prompt_length + ro.response_length}, or leave it null (= prompt_length + response_length).")
