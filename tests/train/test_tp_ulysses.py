"""Tensor parallelism x Ulysses sequence parallelism in one model (lathe.train.tensor_parallel with
lathe.train.ulysses): TP 2 x SP 2 on 4 gloo ranks equals one process.

One spawn of 4 ranks (forks of one forkserver) runs, as one block of 2 x 2 (the tp ranks consecutive, the sp ranks 2
apart; one data-parallel group):
- the learners of `test_ulysses` (a tiny decoder and value model, 4 query and 2 key/value heads: each tp rank holds
  2 and 1, the key/value head repeated over the 2 sp ranks): log-probs, entropy, sum pi^2, values and two PPO updates
  (SGD: a mis-scaled gradient shows) against `test_ulysses`' one-process run;
- the actor and reference workers (AdamW, clipped gradients; `workers.actor` / `workers.reference` make their groups)
  over one update: metrics, the step's clipped gradients, the weights and the reference's log-probs after it, against
  one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel

from lathe.config import ConfigError, load_config
from lathe.models.decoder import LatheCausalLM

from . import test_ulysses
from .test_parallel import COMPARED, run_ranks
from .test_parallel import train as train_one
from .test_ulysses import COMMON, SP, assert_same_run, learners, model_config, share_run

reference = test_ulysses.reference          # the inputs and the one-process run (a module-scoped fixture)

pytestmark = pytest.mark.slow

T, S = 2, 2
WORLD = T * S
TP_KEYS = ["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size", "critic.model.fsdp_config.tensor_parallel_size"]
PACKED = "actor_rollout_ref.model.use_remove_padding=true"
# the actor's and the reference's TP (the reference's Ulysses size is the actor's); the KL in the reward gives the
# reference a mesh of its own (the actor's loss is unchanged)
BOTH = (f"{TP_KEYS[0]}={T}", f"actor_rollout_ref.ref.fsdp_config.tensor_parallel_size={T}", f"{SP[0]}={S}", PACKED,
        "algorithm.use_kl_in_reward=true")
WORKER_STEPS = range(1)      # (the learners above take two steps)


def rank_learners(world: int, batches) -> dict:
    """Log-probs, values and two updates of each learner cut over TP T x SP S (test_ulysses' `rank_run`)."""
    from lathe.config import run_plan
    from lathe.train import parallel
    from lathe.train.tensor_parallel import tensor_parallel
    from lathe.train.ulysses import sequence_parallel
    cfg = load_config(None, [*COMMON, *(f"{k}={T}" for k in TP_KEYS), *(f"{k}={S}" for k in SP),
                             f"trainer.n_gpus_per_node={world}"])
    plan, group, rank = run_plan(cfg), T * S, parallel.rank()
    dp = world // group
    assert (plan.actor.group_size, plan.actor.data_parallel_size, plan.critic.data_parallel_size) == (group, dp, dp)
    tp = tensor_parallel(plan.mesh("actor"), torch.device("cpu"))
    sp = sequence_parallel(S, SP[0], tp=T)
    actor, critic = learners(cfg, plan, sp, tp=tp, mesh=plan.mesh("actor"))
    return {"sp_rank": rank % group, "places": (tp.rank, sp.rank),
            **share_run(actor, critic, batches, dp, rank // group, sp)}


def tp_sp_job(world: int, *, root: str) -> dict:
    """Everything one rank checks (see the module docstring)."""
    batches = torch.load(Path(root) / "batches.pt", weights_only=False)
    return {"learners": rank_learners(world, batches),
            "workers": train_one(world, -1, steps=WORKER_STEPS, tp=T * S, grads=True, ref=True, overrides=BOTH)}


@pytest.fixture(scope="module")
def four_ranks(reference, tmp_path_factory):
    return run_ranks(WORLD, tmp_path_factory.mktemp("tp_sp"), dict(root=str(reference[0])), fn=tp_sp_job)[0]


def test_tp_2_x_sp_2_learners_equal_one_process(four_ranks, reference):
    # tp innermost: ranks 0, 1 are a tensor-parallel group, ranks 0, 2 a sequence-parallel one
    assert [r["learners"]["places"] for r in four_ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert_same_run([{WORLD: r["learners"]} for r in four_ranks], reference, WORLD, WORLD)


def test_tp_2_x_sp_2_workers_update_as_one_process(four_ranks):
    got = four_ranks[0]["workers"]
    one = train_one(1, -1, steps=WORKER_STEPS, grads=True, ref=True, overrides=BOTH[3:])
    assert got["mesh"][0] == (WORLD // T, T)          # FSDP over world / T ranks (the sp ranks among them) x TP
    assert got["ref_mesh"] == (WORLD // T, T)
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="clipped gradients, last step")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    for rank in four_ranks:                           # every rank of the block holds the whole share's results
        assert_close_rel(rank["workers"]["ref_log_prob"], one["ref_log_prob"], rel=1e-5, name="reference log-probs")


# -- one process ---------------------------------------------------------------------------------------------------
def test_tp_with_ulysses_loads_with_world_over_both_data_parallel_groups():
    from lathe.config import run_plan
    cfg = load_config(None, [*COMMON, *(f"{k}={T}" for k in TP_KEYS), *(f"{k}={S}" for k in SP),
                             "trainer.n_gpus_per_node=8"])
    plan = run_plan(cfg)
    for role in (plan.actor, plan.critic):
        assert (role.tensor_parallel_size, role.sequence_parallel_size, role.data_parallel_size) == (T, S, 8 // 4)
    assert plan.mesh("actor").tp == T and plan.mesh("actor").dp_shard == 8 // T
    # 6 devices: TP 2 and SP 3 each divide them, TP 2 x SP 2 does not
    with pytest.raises(ConfigError, match=rf"{TP_KEYS[0]}=2 with {SP[0]}=2: .* blocks of 4 devices"):
        load_config(None, [*COMMON, f"{TP_KEYS[0]}=2", f"{SP[0]}=2", "trainer.n_gpus_per_node=6",
                           "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                           "critic.ppo_mini_batch_size=6"])


@pytest.mark.parametrize("heads, kv, tp, sp, ok", [(4, 2, 2, 2, True), (8, 2, 2, 4, True), (8, 4, 2, 2, True),
                                                   (4, 2, 2, 4, False), (6, 2, 2, 2, False), (8, 1, 2, 2, False)])
def test_heads_must_split_over_tp_times_sp(heads, kv, tp, sp, ok):
    from lathe.train.ulysses import check_model
    with torch.device("meta"):
        model = LatheCausalLM(model_config(heads, kv))
    if ok:
        check_model(model, sp, SP[0], tp, TP_KEYS[0])
        return
    with pytest.raises(ValueError, match=rf"{SP[0]}={sp} with {TP_KEYS[0]}={tp}: each rank of a tensor-parallel "
                                         rf"group holds 1/{tp} of the model's {heads} query heads and {kv} key/value"
                                         rf" heads") as err:
        check_model(model, sp, SP[0], tp, TP_KEYS[0])
    assert f"Fix: set ({TP_KEYS[0]}, {SP[0]}) to such sizes, e.g." in str(err.value)
