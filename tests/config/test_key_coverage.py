"""Every config key either acts or is in the registry (``lathe/config/support.py``) that refuses or warns.

"Acts" is found by a static scan of ``src/lathe`` outside ``config/`` (see ``key_reads.py``); keys the scan
cannot see are listed below with the place that reads them, and each list is checked against the code.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from config.key_reads import Scan, schema_paths
from lathe.config.support import markdown, registry

# Keys whose whole effect happens inside config/ (converted into the key that acts, or decided there).
READ_IN_CONFIG = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "fill.py: converted to ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "fill.py: converted to log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "fill.py: converted to log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "fill.py: converted to ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "fill.py: converted to forward_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.optim.clip_grad": "fill.py: copied to actor.grad_clip",
    "critic.optim.clip_grad": "fill.py: copied to critic.grad_clip",
    **{f"{g}.optim.lr_decay_style": "rules_optim.fill_schedule: copied to optim.lr_scheduler_type (Megatron's name)"
       for g in ("actor_rollout_ref.actor", "critic")},
    "algorithm.rollout_correction.use_policy_gradient": "fill.py: converted to loss_type=reinforce",
    "actor_rollout_ref.rollout.quantization_correction": "fill.py: an FP8 rollout turns token-level TIS on",
    "critic.enable": "plan.py: critic_in_use(), which run_plan (the plan the workers are built from) calls",
    "critic.ppo_mini_batch_size": "plan.py: batch_plan(role='critic'), RunPlan.critic: the critic's mini-batches",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "plan.py: batch_plan(role='actor'), RunPlan.actor: the actor's "
                                                   "mini-batches (and a fully-async step's prompts)",
    **{f"{g}.ulysses_sequence_parallel_size": f"plan.py: sequence_parallel_size(), BatchPlan.sequence_parallel_size "
       f"and RunPlan.ref_sequence_parallel_size: each role's Ulysses groups (lathe.train.ulysses)"
       for g in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    "verl_keys": "tree.py sets what verl_translate.py maps; support_verl.py judges the rest",
    **{f"{g}.fsdp_config.fsdp_size": f"plan.py: mesh_plan(), RunPlan.mesh('{role}'): the mesh (plain FSDP or HSDP) "
                                     "the model is sharded on" for g, role in (("actor_rollout_ref.actor", "actor"),
                                                                               ("actor_rollout_ref.ref", "ref"),
                                                                               ("critic.model", "critic"))},
    **{f"{g}.fsdp_config.expert_parallel_size": f"plan.py: expert_parallel_size(), MeshPlan.ep: the model's "
       f"expert-parallel groups (lathe.train.expert_parallel)"
       for g in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    "distillation.teacher_models": "distill.py: teachers(), the TeacherSpec list the teacher part loads "
                                   "(lathe.workers.teacher)",
    "reward.reward_kwargs": "rules_reward.py: reward_fn_kwargs(), the arguments the user's reward function gets "
                            "(preflight.load_custom_reward), merged with reward_model.reward_kwargs under the batch "
                            "manager",
    "distillation.teacher_key": "distill.py: check_distillation() (rows route by data_source, the column lathe keeps)",
    "actor_rollout_ref.rollout.checkpoint_engine.backend": "rules.py: must agree with the placement, which picks the "
                                                           "sync (nccl: a rollout pool; naive: colocated)",
    **{f"actor_rollout_ref.model.mtp.{k}": "rules_mtp.py: speculative_tokens(), the engine's num_speculative_tokens "
       "(workers/rollout.py, workers/fully_async.py), and check_mtp's rules on the other keys"
       for k in ("enable_rollout", "method", "num_speculative_tokens", "speculative_algorithm",
                 "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_num_steps")},
    "trainer.use_v1": "plan.py: trainer_mode() (false: verl's legacy trainer, lathe's synchronous loop), which "
                      "loop/run.py dispatches on through is_colocate_async()",
}

# Keys the registry says act only in some set-ups (``when``) whose effect is decided inside config/.
REGISTERED_READ_IN_CONFIG = {
    "async_training.require_batches": "fill.py/plan.py: a fully-async step is require_batches x ppo_mini_batch_size "
                                      "prompts (RunPlan.actor.prompts_per_step)",
    "reward_model.micro_batch_size": "fill.py: converted to reward_model.micro_batch_size_per_gpu (no effect without "
                                     "a sequence-classification reward model)",
    "trainer.v1.trainer_mode": "plan.py: trainer_mode() (sync or colocate_async), which loop/run.py dispatches on "
                               "through is_colocate_async()",
}

# Keys read through a name the scan cannot follow; each is checked against the mechanism below.
POLICY_LOSS = ("actor_rollout_ref.actor.{clip_ratio,clip_ratio_low,clip_ratio_high,clip_ratio_c,tau_pos,tau_neg}",
               "actor_rollout_ref.actor.policy_loss.{clip_cov_ratio,clip_cov_lb,clip_cov_ub,kl_cov_ratio,ppo_kl_coef,"
               "dro_beta}")
TORCH_COMPILE = ("actor_rollout_ref.{actor,ref}.use_torch_compile", "actor_rollout_ref.{actor,ref}.fsdp_config.use_torch_compile")
ROLLOUT_CORRECTION = ("algorithm.rollout_correction.{loss_type,rollout_is_threshold,rollout_is_batch_normalize,"
                      "rollout_rs_threshold}",)


def expand(patterns: tuple[str, ...]) -> set[str]:
    """'a.{b,c}.d' -> {'a.b.d', 'a.c.d'} (brace groups, any number)."""
    out: set[str] = set()
    for pattern in patterns:
        if "{" not in pattern:
            out.add(pattern)
            continue
        head, rest = pattern.split("{", 1)
        options, tail = rest.split("}", 1)
        out |= expand(tuple(head + o + tail for o in options.split(",")))
    return out


DYNAMIC_READS = {
    **dict.fromkeys(expand(POLICY_LOSS), "train/actor.py policy_loss_params: getattr over PolicyLossParams' fields"),
    **dict.fromkeys(expand(TORCH_COMPILE), "train/actor.py use_torch_compile(group): getattr on the group"),
    **dict.fromkeys(expand(ROLLOUT_CORRECTION),
                    "loop/steps.py, workers/actor_rollout_ref.py: getattr over ROLLOUT_CORRECTION_KEYS"),
}


@pytest.fixture(scope="module")
def scan() -> Scan:
    return Scan()


def test_every_key_is_read_or_registered(scan):
    leaves, _ = schema_paths()
    known = set(scan.reads) | set(registry()) | set(READ_IN_CONFIG) | set(DYNAMIC_READS)
    missing = sorted(leaves - known)
    assert not missing, ("config keys that no code outside config/ reads and that lathe/config/support.py does not "
                         "list; make them act, or add them to the registry (refused or no effect):\n  "
                         + "\n  ".join(missing))


def test_registry_names_real_keys_lathe_does_not_read(scan):
    leaves, _ = schema_paths()
    assert sorted(set(registry()) - leaves) == [], "stale registry entries (no such key)"
    read = {k: scan.reads[k] for k, entry in registry().items() if k in scan.reads and not entry.when}
    assert not read, f"registered as not acting, but read by the code (drop them from the registry): {read}"
    unread = [k for k, entry in registry().items()
              if entry.when and k not in scan.reads and k not in REGISTERED_READ_IN_CONFIG]
    assert not unread, f"registered as acting on {'/'.join({e.when for e in registry().values() if e.when})} only, " \
                       f"but no code reads them: {unread}"


def test_hand_lists_are_real_and_needed(scan):
    leaves, _ = schema_paths()
    for listed in (READ_IN_CONFIG, DYNAMIC_READS):
        assert sorted(set(listed) - leaves) == []
        assert sorted(set(listed) & set(registry())) == []
        assert sorted(k for k in listed if k in scan.reads) == [], "the scan sees these now: drop them from the list"
    assert all(k in registry() and registry()[k].when and k not in scan.reads for k in REGISTERED_READ_IN_CONFIG)


def test_dynamic_reads_match_their_mechanism():
    from lathe.algo.policy_loss import PolicyLossParams
    from lathe.algo.rollout_correction import ROLLOUT_CORRECTION_KEYS
    from lathe.train import actor
    for key in expand(POLICY_LOSS):
        assert key.rsplit(".", 1)[-1] in PolicyLossParams.__dataclass_fields__, key
    for key in expand(ROLLOUT_CORRECTION):
        assert key.rsplit(".", 1)[-1] in ROLLOUT_CORRECTION_KEYS, key
    source = inspect.getsource(actor.use_torch_compile)
    assert '"use_torch_compile"' in source and '"fsdp_config"' in source


def test_scan_matches_generic_names_on_their_group_only():
    """`.enable` of filter_groups must not count for reward_model.enable; `.format(...)` is no key."""
    scan = Scan(root=None)
    scan.scan_source(
        "def f(cfg, rollout_cfg):\n"
        "    fg = cfg.algorithm.filter_groups\n"
        "    t = cfg.trainer\n"
        "    if fg.enable and t.device:\n"
        "        '{}'.format(rollout_cfg.multi_turn)\n"
        "    src = rollout_cfg.val_kwargs if fg else rollout_cfg\n"
        "    return src.top_k, getattr(cfg.data, 'seed')\n", "snippet.py")
    assert set(scan.reads) == {"algorithm.filter_groups.enable", "trainer.device", "data.seed",
                               "actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.val_kwargs.top_k",
                               "reward_model.rollout.top_k"}      # the judge's engine group is a `rollout` too


def test_docs_list_is_generated_from_the_registry():
    docs = Path(__file__).resolve().parents[2] / "docs" / "config_keys.md"
    assert docs.read_text() == markdown() + "\n", \
        "docs/config_keys.md is stale; regenerate it as lathe/config/support.py's docstring says"
