"""LoRA on two Ray workers (FSDP2 ranks over gloo on CPU): the same updates as one process, only the adapters
change, each rank's engine holds the merged weights, and the checkpoints (PEFT adapter + merged model) resume
exactly in one process (a 2-rank one) and on 2 ranks (a one-process one).

One Ray cluster and one run of each kind serve every test (module fixture): 2 updates on the same batches, a
checkpoint, a third update; then each checkpoint is resumed on the other worker count and the third update
compared."""

from __future__ import annotations

import sys

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from helpers import assert_close_rel  # noqa: E402
from lathe.config import load_config, run_plan  # noqa: E402
from lathe.generation import RolloutOutput  # noqa: E402
from lathe.rollout.base import to_batch  # noqa: E402
from lathe.train import parallel  # noqa: E402
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

pytestmark = pytest.mark.slow
OVERRIDES = ["actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.model.use_remove_padding=true",
             "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.lora_rank=4",
             "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]",
             "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.n_gpus_per_node=2", "trainer.device=cpu"]
REL = 1e-5          # two ranks sum gradients in another order than one process
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


class ProbedWorker(ActorRolloutRefWorker):
    """The actor worker, plus what the test reads back from a rank."""

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, on rank 0 (every rank gathers; {} elsewhere); a copy in one process."""
        if parallel.in_group():
            return dict(parallel.full_state(self.model))
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """This rank's engine weights (its own full copy)."""
        return {k: v.detach().clone() for k, v in self.rollout.backend.model.state_dict().items()}


def make_worker(cfg, device_count: int | None = None) -> ProbedWorker:
    """A rank's worker, or with `device_count=1` the one-process worker the ranks are compared with."""
    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.hf import build_builtin_model
    tok = builtin_tokenizer()
    return ProbedWorker(cfg, build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok,
                        plan=run_plan(cfg, device_count), total_steps=10, device=torch.device("cpu"))


def ppo_batch(worker, seed: int):
    """8 ragged sequences with the one-process worker's old and reference log-probs and random advantages."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: torch.randint(3, 60, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist()
    prompts, responses = [draw(2, 6) for _ in range(8)], [draw(1, 7) for _ in range(8)]
    batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * 8), 0, n=1)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = worker.compute_log_prob(batch)["old_log_probs"]
    batch["ref_log_prob"] = worker.compute_ref_log_prob(batch)["ref_log_prob"]
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    return batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from lathe.cluster.placement import ResourcePool, start_ray
    from lathe.cluster.roles import ACTOR, ActorRolloutRefGroup
    from lathe.cluster.worker_group import RayWorkerGroup
    root = tmp_path_factory.mktemp("lora")
    cfg = load_config(None, OVERRIDES)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = start_ray(cfg)
    group = RayWorkerGroup(ResourcePool(1, 2, use_gpu=False, timeout_s=120), name="lora", timeout_s=120)
    try:
        group.build(ACTOR, make_worker, cfg)
        two = ActorRolloutRefGroup(group, pad_id=0, mini_batch_size=4, balance=False, has_ref=True)
        one = make_worker(cfg, 1)
        out = {"start": group.call(ACTOR, "full_weights")[0], "one": [], "two": []}
        batches = [ppo_batch(one, seed) for seed in (1, 2)]
        out["log_probs"] = (two.compute_log_prob(batches[0]), two.compute_ref_log_prob(batches[0]), batches[0])
        for batch in batches:
            out["one"].append(one.update_actor(batch))
            out["two"].append(two.update_actor(batch))
        one.sync_weights()
        two.sync_weights()
        out["weights"] = (one.full_weights(), group.call(ACTOR, "full_weights")[0])
        out["engines"] = group.call(ACTOR, "engine_weights")
        one.save_checkpoint(root / "one")
        two.save_checkpoint(root / "two")
        third = ppo_batch(one, 3)
        out["third"] = {"one": one.update_actor(third), "two": two.update_actor(third)}
        out["third_weights"] = group.call(ACTOR, "full_weights")[0]
        restored = make_worker(cfg, 1)               # one process from the 2-rank checkpoint
        restored.load_checkpoint(root / "two")
        out["third"]["one from two"] = restored.update_actor(third)
        out["third_weights_one_from_two"] = restored.full_weights()
        two.load_checkpoint(root / "one")            # 2 ranks from the one-process checkpoint
        out["third"]["two from one"] = two.update_actor(third)
        yield root, out
    finally:
        group.shutdown()
        if started:
            ray.shutdown()


def assert_same(a: dict, b: dict) -> None:
    """The losses (normalised by the whole mini-batch's counts) and the gradient norm; the per-micro-batch means
    (ppo_kl, clip fractions) are averaged by rows, so they depend on how the batch is cut into ranks."""
    for key in COMPARED:
        assert abs(a[key] - b[key]) <= REL * max(abs(a[key]), 1e-3), (key, a[key], b[key])


def adapters(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith(("lora_A", "lora_B"))}


def test_two_workers_update_as_one_process(runs):
    _, out = runs
    logp, ref, batch = out["log_probs"]
    assert_close_rel(logp["old_log_probs"], batch["old_log_probs"], rel=REL, name="old log-probs")
    assert_close_rel(ref["ref_log_prob"], batch["ref_log_prob"], rel=REL, name="reference (adapters off)")
    for a, b in zip(out["one"], out["two"]):
        assert_same(a, b)
    one, two = out["weights"]
    assert_close_rel(adapters(two), adapters(one), rel=REL, name="adapters after 2 steps")


def test_only_the_adapters_train_and_each_engine_holds_the_merged_weights(runs):
    _, out = runs
    start, (_, two) = out["start"], out["weights"]
    changed = {k for k in start if not torch.equal(start[k], two[k])}
    assert changed and all(k.endswith(("lora_A", "lora_B")) for k in changed), changed
    assert any(k.endswith("lora_B") for k in changed), "B left zero: the adapters did not learn"
    paths = sorted(k[:-len(".lora_A")] for k in two if k.endswith(".lora_A"))
    assert len(paths) == 3 * 3                                  # q, v, down of the tiny model's 3 layers
    merged = {f"{p}.weight": two[f"{p}.weight"].double()                  # W + (alpha / r) B A, alpha / r = 2
              + 2.0 * two[f"{p}.lora_B"].double() @ two[f"{p}.lora_A"].double() for p in paths}
    for rank, engine in enumerate(out["engines"]):
        assert_close_rel({k: engine[k] for k in merged}, merged, rel=1e-6, name=f"rank {rank}'s engine")
        rest = [k for k in engine if k not in merged and k in start]
        assert rest and all(torch.equal(engine[k], start[k]) for k in rest), f"rank {rank}: base weights moved"


def test_checkpoints_hold_the_adapter_and_merged_model_and_resume_exactly_on_other_worker_counts(runs):
    from safetensors.torch import load_file
    root, out = runs
    for run in ("one", "two"):
        assert (root / run / "lora_adapter" / "adapter_config.json").exists(), run
    assert not (root / "two" / "sharded").exists(), "the frozen base is not written again"
    files = {run: (load_file(root / run / "lora_adapter" / "adapter_model.safetensors"),
                   load_file(next((root / run / "huggingface").glob("*.safetensors")))) for run in ("one", "two")}
    assert_close_rel(files["two"][0], files["one"][0], rel=REL, name="PEFT adapters")
    assert_close_rel(files["two"][1], files["one"][1], rel=REL, name="merged Hugging Face weights")
    third = out["third"]
    assert_same(third["one"], third["two"])
    assert_same(third["two"], third["one from two"])            # a 2-rank checkpoint resumed in one process
    assert_same(third["one"], third["two from one"])            # a one-process checkpoint resumed on 2 ranks
    assert_close_rel(adapters(out["third_weights_one_from_two"]), adapters(out["third_weights"]), rel=REL,
                     name="adapters after the resumed third step")
