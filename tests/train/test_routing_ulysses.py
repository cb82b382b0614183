"""lathe.train.routing beside Ulysses sequence parallelism: 2 gloo ranks (one sequence-parallel group of 2, FSDP2 over
both) replay MoE routing as one process does, in float64 on a tiny Qwen3-MoE (2 sparse layers, 4 experts, top-2).

- R2: the old-log-prob pass (micro-batches of 3 sequences; each group's packed stream padded to divide by 2) records
  on every rank the routing one process records, -1 at padding; the update (other micro-batches: 1 sequence each)
  of a policy whose routers moved since replays it: metrics (`actor/routing_replay_changed`: real tokens over the
  group), and the weights after SGD (the gradients, scale included) equal one process's. The same update with the
  experts shifted equals one process's too, and differs from it: the replayed routing is used.
- R3: the routing lathe's engine recorded when it sampled the batch (`rollout.base.to_batch`'s layout), before the
  routers moved, makes the old-log-prob pass's log-probs one process's, which differ from the unreplayed ones.
Replay without Ulysses is tests/train/test_routing.py's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel, gloo_rank, one_thread, spawn_saving_ranks

from lathe.batch import Batch
from lathe.rollout.base import ROUTED

from .test_expert_parallel import tiny_moe
from .test_ulysses import COMMON

S, JOIN_S = 2, 120
REL = 1e-10                              # float64: the same sums in another order
CHANGED = "actor/routing_replay_changed"
PROMPTS = [[5, 9, 2, 33, 8], [4, 4, 12], [5, 9, 2, 17], [30, 21]]


def perturbed(model, seed: int):
    """`model` with every router moved (as an optimizer step since the recording would)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


def inputs() -> dict:
    """The step's batch from lathe's engine (tiny_moe in fp32, its routing recorded: R3's), the float64 policy."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.rollout.base import to_batch
    engine = LatheEngine(tiny_moe(), eos_token_id=[3, 7], block_size=4, num_kv_blocks=64, record_routing=True)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5))
    batch = to_batch(PROMPTS, out, pad_id=0, n=2)
    g = torch.Generator().manual_seed(7)
    mask = batch["response_mask"].double()
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g, dtype=torch.float64).expand(mask.shape) * mask
    batch["ref_log_prob"] = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
    return {"batch": batch, "policy": perturbed(tiny_moe().double(), seed=11)}    # routers moved since the rollout


def run(policy, batch: Batch, sp=None) -> dict:
    """R3's and R2's old-log-prob passes, then R2's update of the moved policy (and with the experts shifted)."""
    from lathe.config import load_config, run_plan
    from lathe.train import parallel
    from lathe.train.actor import PPOActor
    from lathe.train.logprob import batched_token_stats
    from lathe.train.routing import LogProbRouting
    size = 1 if sp is None else sp.size
    cfg = load_config(None, [*COMMON, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}",
                             f"trainer.n_gpus_per_node={size}"])
    plan = run_plan(cfg)
    out = {"mask": batch["attention_mask"].bool()}
    for mode in ("R3", "R2", None):
        routing = LogProbRouting(mode, policy, True, sp) if mode else None
        logp, _, _ = batched_token_stats(policy, batch, micro_batch_size=3, temperature=0.7, remove_padding=True,
                                         sp=sp, around=routing)
        out[mode] = {"logp": logp, "recorded": routing.result() if mode == "R2" else None}
    recorded = out["R2"]["recorded"]
    mask = batch["attention_mask"].bool()[..., None, None]
    for name, routed in (("right", recorded), ("shifted", torch.where(mask, (recorded + 1) % 4, recorded))):
        model = perturbed(policy, seed=12)
        if sp is not None:
            parallel.shard_model(model, device=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        actor = PPOActor(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
                         cfg.actor_rollout_ref.actor, mini_batch_size=plan.actor.mini_batch_sequences_per_device,
                         temperature=0.7, max_response_length=6, use_remove_padding=True, sp=sp)
        step = Batch({**batch.tensors, "old_log_probs": out["R2"]["logp"], ROUTED: routed.to(torch.int16)})
        out[name] = {"metrics": actor.update_policy(step),
                     "weights": {k: t.clone() for k, t in parallel.full_tensors(model)} if sp is not None else
                     {k: p.detach().clone() for k, p in model.named_parameters()}}
    return out


def rank_main(rank: int, port: int, root: str, queue) -> None:
    def work():
        from lathe.train.ulysses import sequence_parallel
        given = torch.load(Path(root) / "inputs.pt", weights_only=False)
        torch.save(run(given["policy"], given["batch"], sequence_parallel(S)), Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, S, port, queue, work, JOIN_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process's results, each rank's)."""
    root = tmp_path_factory.mktemp("routing_ulysses")
    given = inputs()
    torch.save(given, root / "inputs.pt")
    with one_thread():
        one = run(copy.deepcopy(given["policy"]), given["batch"])
    return one, spawn_saving_ranks(rank_main, S, root, [__name__, "lathe.config", "lathe.train.actor",
                                                        "torch.distributed.fsdp"], JOIN_S)


def test_r2_records_the_routing_one_process_records(runs):
    one, ranks = runs
    want = one["R2"]["recorded"]
    assert want.dtype == torch.int16 and torch.equal((want >= 0).all(-1).all(-1), one["mask"])   # -1 at padding
    tokens = one["mask"].sum(1)
    assert any(int(tokens[i:i + 3].sum()) % S for i in (0, 3, 6)), "some micro-batch's stream must need padding"
    for rank in ranks:
        assert torch.equal(rank["R2"]["recorded"], want)


def test_log_probs_of_each_mode_equal_one_process(runs):
    one, ranks = runs
    for mode in ("R3", "R2", None):
        for rank in ranks:
            assert_close_rel(rank[mode]["logp"], one[mode]["logp"], REL, name=f"log-probs, {mode}")
    gap = (one["R3"]["logp"] - one[None]["logp"]).norm() / one[None]["logp"].norm()
    assert gap > 1e-4, "R3's routing must change the log-probs (else the test shows nothing)"


@pytest.mark.parametrize("routing", ["right", "shifted"])
def test_r2_update_equals_one_process(runs, routing):
    one, ranks = runs
    want = one[routing]
    assert 0 < want["metrics"][CHANGED] < 1
    for rank in ranks:
        got = rank[routing]
        assert set(got["metrics"]) == set(want["metrics"])
        assert_close_rel({k: torch.tensor(v) for k, v in got["metrics"].items()},
                         {k: torch.tensor(v) for k, v in want["metrics"].items()}, REL, name=f"metrics, {routing}")
        assert_close_rel({k: got["weights"][k] for k in want["weights"]}, want["weights"], REL,
                         name=f"weights, {routing}")


def test_the_replayed_routing_is_used(runs):
    one, ranks = runs
    for run_ in (one, *ranks):
        right, shifted = run_["right"]["weights"], run_["shifted"]["weights"]
        moved = sum(float((right[k] - shifted[k]).norm()) for k in right)
        assert moved > 1e-3 * sum(float(right[k].norm()) for k in right)
