"""The MTP update (`lathe.train.mtp`) beside Ulysses sequence parallelism: 2 gloo ranks (one sequence-parallel group of
2, FSDP2 over both) train a tiny float64 MiMo (2 MTP layers) exactly as one process does, with `detach_encoder` on
and off: the `actor/mtp_losses/mtp_<k>_loss` metrics (and the rest of the update's), and the SGD updates (so the
gradients, scale included) of the MTP layers and of the main model.

The mini-batch is two packed micro-batches whose layouts are the cases that matter: in the first, the boundary
between its two sequences falls exactly on the edge of the ranks' slices (rank 0's last token ends a sequence: its
shifted token must be the fill, not rank 1's first); in the second, the boundary falls inside rank 0's slice and the
next sequence runs on into rank 1's (rank 0's last positions read their shifted tokens and targets from rank 1's
slice), and the stream is padded to divide by 2. The config rule is tests/train/test_mtp.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import assert_close_rel, gloo_rank, one_thread, spawn_saving_ranks

from lathe.batch import Batch

from .conftest import VOCAB
from .test_mtp_parallel import mimo_model as mimo_with_mtp

pytestmark = pytest.mark.slow

S, JOIN_S, PAD = 2, 120, 0
REL = 1e-10                               # float64: the same sums in another order
MICRO = 2                                 # rows per micro-batch
# (prompt, response) lengths: micro-batch 1 packs 6 + 6 tokens (the boundary on the slice edge), micro-batch 2
# 5 + 8 = 13 (padded to 14: slices of 7, the boundary at 5 inside rank 0's)
LENGTHS = [(3, 3), (4, 2), (2, 3), (5, 3)]
CONFIG = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}", "actor_rollout_ref.actor.grad_clip=1000.0",
          "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.temperature=0.7",
          "actor_rollout_ref.model.use_remove_padding=true", "data.max_prompt_length=5", "data.max_response_length=3",
          "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
          "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.5"]
METRICS = ("actor/mtp_losses/mtp_1_loss", "actor/mtp_losses/mtp_2_loss")


def mimo_model():
    """`test_mtp_parallel.mimo_model` with 2 MTP layers (the second's ids shifted by 2), float64."""
    return mimo_with_mtp(layers=2).double()


def step_batch() -> Batch:
    """The update's rows (`LENGTHS`), a hole in one response's mask, old log-probs off the policy, advantages."""
    from lathe.generation import RolloutOutput
    from lathe.rollout.base import to_batch
    from lathe.train.logprob import response_log_probs
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (p,), generator=g).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(2, VOCAB, (r,), generator=g).tolist() for _, r in LENGTHS]
    batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * len(LENGTHS)),
                     PAD, n=1)
    mask = batch["response_mask"].clone()
    mask[3, 1] = 0                            # a masked token inside a response (a tool's output)
    batch["response_mask"] = mask
    with torch.no_grad():
        logp, _ = response_log_probs(mimo_model(), batch, temperature=0.7, remove_padding=True)
    m = mask.double()
    batch["old_log_probs"] = (logp + 0.1 * torch.randn(m.shape, generator=g, dtype=torch.float64)) * m
    batch["advantages"] = torch.randn(m.shape[0], 1, generator=g, dtype=torch.float64).expand(m.shape) * m
    return batch


def update(batch: Batch, detach: bool, sp=None) -> dict:
    """One actor update (SGD, constant lr): its metrics and the weights after it."""
    from lathe.config import load_config, run_plan
    from lathe.train import parallel
    from lathe.train.actor import PPOActor
    from lathe.train.mtp import mtp_training
    size = 1 if sp is None else sp.size
    cfg = load_config(None, [*CONFIG, f"actor_rollout_ref.model.mtp.detach_encoder={str(detach).lower()}",
                             f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}",
                             f"trainer.n_gpus_per_node={size}"])
    plan = run_plan(cfg)
    model = mimo_model()
    mtp = mtp_training(cfg.actor_rollout_ref.model.mtp, model, "tiny MiMo")
    if sp is not None:
        parallel.shard_model(model, device=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    actor = PPOActor(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
                     cfg.actor_rollout_ref.actor, mini_batch_size=plan.actor.mini_batch_sequences_per_device,
                     temperature=0.7, max_response_length=3, use_remove_padding=True, sp=sp, mtp=mtp)
    metrics = actor.update_policy(batch)
    weights = ({k: t.clone() for k, t in parallel.full_tensors(model)} if sp is not None else
               {k: p.detach().clone() for k, p in model.named_parameters()})
    return {"metrics": metrics, "weights": weights}


def rank_main(rank: int, port: int, root: str, queue) -> None:
    def work():
        from lathe.train.ulysses import sequence_parallel
        sp = sequence_parallel(S)
        batch = torch.load(Path(root) / "batch.pt", weights_only=False)
        torch.save({d: update(batch, d, sp) for d in (True, False)}, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, S, port, queue, work, JOIN_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the batch, one process's updates by detach_encoder, each rank's)."""
    root = tmp_path_factory.mktemp("mtp_ulysses")
    batch = step_batch()
    torch.save(batch, root / "batch.pt")
    with one_thread():
        one = {d: update(batch, d) for d in (True, False)}
    ranks = spawn_saving_ranks(rank_main, S, root, [__name__, "lathe.config", "lathe.train.actor",
                                                    "torch.distributed.fsdp"], JOIN_S)
    return batch, one, ranks


def _deltas(weights: dict, part: str) -> dict:
    start = dict(mimo_model().named_parameters())
    mtp = {k for k in weights if k.startswith("model.mtp_layers.")}
    keys = mtp if part == "mtp" else set(weights) - mtp
    return {k: weights[k] - start[k].detach() for k in sorted(keys)}


def test_the_micro_batches_put_a_sequence_boundary_on_and_inside_the_slice_edge(runs):
    batch, _, _ = runs
    tokens = batch["attention_mask"].sum(-1).tolist()
    first, second = sum(tokens[:MICRO]), sum(tokens[MICRO:])
    assert tokens[0] == first // S and first % S == 0          # micro-batch 1: the boundary is the slice edge
    per = -(-second // S)
    assert second % S and tokens[MICRO] < per < second        # micro-batch 2: inside rank 0's slice, padded


@pytest.mark.parametrize("detach", [True, False])
def test_two_ranks_train_the_mtp_layers_as_one_process(runs, detach):
    _, one, ranks = runs
    want = one[detach]
    assert all(want["metrics"][k] > 0 for k in METRICS)
    for rank in ranks:
        got = rank[detach]
        assert set(got["metrics"]) == set(want["metrics"])
        assert_close_rel({k: torch.tensor(v) for k, v in got["metrics"].items()},
                         {k: torch.tensor(v) for k, v in want["metrics"].items()}, REL, name="metrics")
        for k in METRICS:                  # each on its own: the MTP loss is a small part of the metrics' norm
            assert abs(got["metrics"][k] - want["metrics"][k]) <= REL * want["metrics"][k], k
        for part in ("mtp", "main"):
            assert_close_rel(_deltas(got["weights"], part), _deltas(want["weights"], part), REL,
                             name=f"{part} update, detach_encoder={detach}")


def test_detach_encoder_changes_the_main_model_update(runs):
    """(else the comparison above would not show that the MTP gradient reaches the main model across the ranks). As
    verl's patch of Megatron's MTP layers, each layer's input is detached, the previous MTP layer's output too: only
    the last MTP layer learns the same either way."""
    _, one, _ = runs
    main = [_deltas(one[d]["weights"], "main") for d in (True, False)]
    gap = sum(float((main[0][k] - main[1][k]).norm()) for k in main[0])
    assert gap > 1e-4 * sum(float(v.norm()) for v in main[1].values())
    last = [{k: v for k, v in _deltas(one[d]["weights"], "mtp").items() if k.startswith("model.mtp_layers.1.")}
            for d in (True, False)]
    assert_close_rel(last[0], last[1], REL, name="the last MTP layer's update")
