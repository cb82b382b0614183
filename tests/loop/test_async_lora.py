"""LoRA in fully-async mode: the weight sync sends only the adapted layers' merged weights (`W + s B A`, what the
synchronous path loads into its engine), and the replica loads them over its base model (both pools in this
process: tests/loop/test_async_inprocess.py). On-policy it is the synchronous loop's LoRA run."""

from __future__ import annotations

from helpers import warm_started
from lathe.models.hf import load_policy
from loop.test_async_inprocess import ON_POLICY, assert_same_steps, in_process_pools, train  # noqa: F401

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "actor_rollout_ref.actor.optim.lr=2e-2"]


def test_on_policy_lora_syncs_only_the_adapted_layers_and_is_the_synchronous_loop(tmp_path, in_process_pools):
    sync = train(tmp_path / "sync", *LORA)
    on_policy = train(tmp_path / "async", *LORA, *ON_POLICY, "data.gen_batch_size=4")
    assert_same_steps(sync, on_policy)
    # the replica samples with the trainer's updated weights: the engine's log-probs are the trainer's at step 2
    for row in on_policy:
        assert row["fully_async/rollout_probs_diff_current_max"] < 1e-4, row
    # a sync sends the q and v projections only, in the rollout dtype (float32 on the CPU)
    model = load_policy(warm_started(30)[0].split("=", 1)[1])
    state = model.state_dict()
    adapted = sum(t.numel() for name, t in state.items() if name.endswith(("q_proj.weight", "v_proj.weight")))
    fraction = adapted / sum(t.numel() for t in state.values())
    for row in on_policy:
        assert abs(row["fully_async/sync/fraction_of_full"] - fraction) < 1e-9, (row, fraction)
        assert abs(row["fully_async/sync/gb"] * 2**30 - 4 * adapted) < 1, row


def test_a_sharded_trainer_lists_the_merged_layers_it_sends_without_gathering(tmp_path):
    """A trainer rank of a process group (FSDP2; one rank here) lists the sync's tensors from the shards' full shapes,
    in the order `Actor.weights()` gathers and merges them: the adapted layers only."""
    import torch.distributed as dist

    from helpers import free_port
    from lathe.config import load_config
    from lathe.config.plan import run_plan
    from lathe.models.hf import load_tokenizer
    from lathe.workers.build import build_async_trainer
    path = warm_started(30)[0].split("=", 1)[1]
    cfg = load_config("default", [*warm_started(30), *LORA, *ON_POLICY, f"trainer.default_local_dir={tmp_path}"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        trainer = build_async_trainer(cfg, run_plan(cfg), path, {}, load_tokenizer("builtin:tiny"), total_steps=2,
                                      device_type="cpu")
        assert trainer.worker.actor.sharded
        sent = [(name, tuple(t.shape)) for name, t in trainer.worker.actor.weights()]
        assert [(m.name, m.shape) for m in trainer.weight_metas()] == sent
        assert sent and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name, _ in sent)
    finally:
        dist.destroy_process_group()


def test_the_replicas_start_from_a_given_adapter(tmp_path, in_process_pools):
    """With `lora_adapter_path` the replicas load the base model, then take the merged adapters before generating:
    the first step's tokens have the log-probs the trainer (base + adapters) computes."""
    import torch

    from lathe.models.lora import apply_lora, save_adapter
    model = load_policy(warm_started(30)[0].split("=", 1)[1])
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    save_adapter(model, tmp_path / "adapter")
    rows = train(tmp_path / "async", *LORA, *ON_POLICY, "data.gen_batch_size=4", "trainer.total_training_steps=1",
                 f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}")
    assert rows[0]["fully_async/rollout_probs_diff_current_max"] < 1e-4, rows[0]
