"""A LoRA critic on 2 gloo ranks (`lathe.workers.critic` in a group: FSDP2, tensor parallelism 2, Ulysses 2): its
updates equal one process's (metrics, adapters and head), the base stays frozen, and the checkpoint the FSDP ranks
write (the adapter and head gathered whole) resumes in one process as the uninterrupted run continues."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import assert_close_rel
from lathe.cluster.dispatch import select_share, update_shares
from lathe.config import load_config, run_plan
from lathe.data.builtin import builtin_tokenizer
from lathe.train import parallel
from lathe.workers.critic import CriticWorker

from .conftest import BASE_OVERRIDES
from .test_critic import CRITIC, _value_model
from .test_parallel import ppo_batch, run_ranks

pytestmark = pytest.mark.slow

LORA = ("algorithm.adv_estimator=gae", "critic.model.lora_rank=4", "critic.model.lora_alpha=8",
        "critic.model.use_remove_padding=true")
COMPARED = ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/lr")


def critic_batch(step: int):
    batch = ppo_batch(step)
    g = torch.Generator().manual_seed(100 + step)
    mask = batch["response_mask"].float()
    batch["values"] = 0.5 * torch.randn(mask.shape, generator=g) * mask
    batch["returns"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    return batch


def critic_job(world: int, *, steps=range(2), save: Path | None = None, resume: Path | None = None,
               group: int = 1, overrides: tuple[str, ...] = ()) -> dict:
    """LoRA critic updates over `steps` on this process's share (a rank of `world`, or one process; with tensor- or
    sequence-parallel groups of `group` ranks, its group's share)."""
    cfg = load_config(None, [*BASE_OVERRIDES, *CRITIC, *LORA, "trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                             *overrides], device_count=world)
    plan = run_plan(cfg, world)
    worker = CriticWorker(cfg, builtin_tokenizer(), plan=plan.critic, total_steps=10, device="cpu",
                          model=_value_model(0), mesh=plan.mesh("critic") if parallel.in_group() else None)
    if resume is not None:
        worker.load_checkpoint(resume)
    metrics = []
    for step in steps:
        batch = critic_batch(step)
        shares = update_shares(batch, world // group, mini_batch_size=plan.critic.mini_batch_sequences, balance=False)
        metrics.append(worker.update_critic(select_share(batch, shares[parallel.rank() // group])))
    if save is not None:
        worker.save_checkpoint(save)
    return {"metrics": metrics, "weights": parallel.full_state(worker.model),
            "trained": sorted(n for n, p in worker.model.named_parameters() if p.requires_grad)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process; on 2 ranks: FSDP 2 (saving), tensor parallelism 2, Ulysses 2."""
    root = tmp_path_factory.mktemp("critic_lora")
    tp, sp = "critic.model.fsdp_config.tensor_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"
    return root, critic_job(1), run_ranks(2, root / "ranks", dict(save=root / "ckpt"), dict(group=2, overrides=(tp,)),
                                          dict(group=2, overrides=(sp,)), fn=critic_job)


@pytest.mark.parametrize("job", ["fsdp", "tp", "ulysses"])
def test_a_lora_critic_on_2_ranks_updates_as_one_process(runs, job):
    _, one, jobs = runs
    ranks = jobs[["fsdp", "tp", "ulysses"].index(job)]
    start = _value_model(0).state_dict()
    for got in ranks:
        assert got["trained"] == one["trained"] and "score.weight" in got["trained"]
        for a, b in zip(got["metrics"], one["metrics"], strict=True):
            assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    weights = ranks[0]["weights"]
    assert_close_rel(weights, one["weights"], rel=1e-5, name="weights after 2 updates")
    frozen = [k for k in weights if k in start and not k.startswith("score.")]
    assert frozen and all(torch.equal(weights[k], start[k]) for k in frozen), "the base changed"


def test_the_checkpoint_of_2_ranks_resumes_in_one_process_as_the_uninterrupted_run_continues(runs):
    root = runs[0]
    whole = critic_job(1, steps=range(3))
    resumed = critic_job(1, steps=range(2, 3), resume=root / "ckpt")
    assert_close_rel([resumed["metrics"][0][k] for k in COMPARED], [whole["metrics"][2][k] for k in COMPARED],
                     rel=1e-5, name="the resumed step")
    assert_close_rel(resumed["weights"], whole["weights"], rel=1e-5, name="weights after the resumed step")
