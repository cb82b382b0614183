"""Tests for lathe.train.memory: the start-up memory plan (what lives where, and whether the update fits)."""

import pytest
import torch

import lathe.train.memory as memory
from lathe.train.memory_models import other_model_parts
from lathe.config import load_config

N = 1_000_000_000           # 1B parameters: bf16 = 1.86 GiB, fp32 = 3.73 GiB
CUDA = torch.device("cuda")


def _plan(*overrides, need_ref=True, total_gib=80.0, lathe_engine=True, monkeypatch=None):
    monkeypatch.setattr(memory, "total_memory", lambda device: int(total_gib * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", *overrides])
    parts = memory.plan(cfg, N, CUDA, need_ref=need_ref, critic_params=None, lathe_engine=lathe_engine)
    return parts, *memory.format_plan(parts, CUDA, 0.5)


def _gib(parts, what):
    return next(p.nbytes for p in parts if p.what.startswith(what)) / 2**30


def test_mixed_precision_parts_and_sizes(monkeypatch):
    parts, text, fits = _plan(monkeypatch=monkeypatch)
    assert _gib(parts, "actor weights, bf16, shared with the rollout engine") == pytest.approx(2 * N / 2**30)
    assert _gib(parts, "actor master weights, fp32") == pytest.approx(4 * N / 2**30)
    assert _gib(parts, "actor gradients, fp32") == pytest.approx(4 * N / 2**30)
    assert _gib(parts, "actor AdamW moments") == pytest.approx(8 * N / 2**30)
    assert _gib(parts, "reference weights, bf16") == pytest.approx(2 * N / 2**30)
    assert not any(p.what.startswith("rollout weights") for p in parts), "the engine runs on the actor's bf16 weights"
    assert fits and "GPU during the update: 18.63 GiB + activations" in text


def test_offload_moves_parts_to_cpu_and_says_which_key(monkeypatch):
    parts, text, _ = _plan("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                           "actor_rollout_ref.ref.fsdp_config.param_offload=true", monkeypatch=monkeypatch)
    moments = next(p for p in parts if "moments" in p.what)
    assert not moments.on_gpu and "optimizer_offload=true" in text and "CPU (pinned): 9.31 GiB" in text


def test_an_update_that_cannot_fit_is_refused_with_the_keys_that_would_make_it_fit(monkeypatch):
    _, text, fits = _plan(total_gib=16.0, monkeypatch=monkeypatch)
    assert not fits
    assert "DOES NOT FIT" in text and "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true saves 7.5 GiB" in text


def test_a_transformers_rollout_keeps_its_own_copy(monkeypatch):
    parts, _, _ = _plan(lathe_engine=False, monkeypatch=monkeypatch)
    assert _gib(parts, "rollout weights, bf16") == pytest.approx(2 * N / 2**30)


def test_the_critic_has_its_own_masters_moments_and_offload_key(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", "algorithm.adv_estimator=gae",
                               "critic.model.fsdp_config.optimizer_offload=true"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=N, lathe_engine=True)
    assert _gib(parts, "critic master weights, fp32") == pytest.approx(4 * N / 2**30)
    moments = next(p for p in parts if p.what.startswith("critic AdamW moments"))
    assert not moments.on_gpu and moments.why == "critic.model.fsdp_config.optimizer_offload=true"


def test_a_lora_critic_plans_a_frozen_base_and_the_masters_and_moments_of_its_adapters_and_head(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", "algorithm.adv_estimator=gae", "critic.model.lora_rank=8"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=N, lathe_engine=True, critic_lora=20_000_000)
    assert _gib(parts, "critic base weights (frozen), bf16") == pytest.approx(2 * N / 2**30)
    assert _gib(parts, "critic LoRA adapters and value head master weights, fp32") == pytest.approx(4 * 20e6 / 2**30)
    assert _gib(parts, "critic LoRA adapters and value head AdamW moments") == pytest.approx(8 * 20e6 / 2**30)
    assert not any(p.what.startswith("critic master") for p in parts), "no masters of the frozen base"


def _kv_plan(utilization, monkeypatch, seqs=256):
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu"])
    parts = memory.plan(cfg, N, CUDA, need_ref=True, critic_params=None, lathe_engine=True)
    return memory.format_plan(parts, CUDA, utilization, kv_seq_bytes=2**28, seqs=seqs)   # 0.25 GiB a sequence


def test_no_room_for_the_kv_cache_is_refused_up_front_with_the_utilization_that_fits(monkeypatch):
    # resident while generating: bf16 weights 1.86 + fp32 masters 3.73 + moments 7.45 + reference 1.86 = 14.9 GiB
    text, fits = _kv_plan(0.18, monkeypatch)        # 14.4 GiB of 80: no sequence fits
    assert not fits and "DOES NOT FIT while generating" in text
    assert "gpu_memory_utilization=0.95" in text and "optimizer_offload=true saves 7.5 GiB" in text
    assert "gradients" not in text.split("Fix:")[-1], "gradients do not exist while generating"


def test_a_batch_that_does_not_fit_at_once_is_said_but_runs(monkeypatch):
    text, fits = _kv_plan(0.5, monkeypatch, seqs=256)          # 25 GiB of KV; 64 GiB wanted
    assert fits and "the engine will preempt" in text and "gpu_memory_utilization=0.95" in text
    text, fits = _kv_plan(0.5, monkeypatch, seqs=64)           # 16 GiB wanted: fits
    assert fits and "preempt" not in text and "gpu_memory_utilization=0.45" not in text


def test_lora_plans_a_frozen_base_small_adapters_no_reference_and_merged_engine_layers(monkeypatch):
    """7B-like: a 1B base whose adapted layers hold 0.8B parameters, 20M adapter parameters."""
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "actor_rollout_ref.model.lora_rank=8"])
    parts = memory.plan(cfg, N, CUDA, need_ref=True, critic_params=None, lathe_engine=True, lora=(20_000_000, 800_000_000))
    assert _gib(parts, "actor base weights (frozen), bf16") == pytest.approx(2 * N / 2**30)
    assert _gib(parts, "actor LoRA adapters AdamW moments") == pytest.approx(8 * 20e6 / 2**30)
    assert _gib(parts, "rollout merged weights, bf16") == pytest.approx(2 * 800e6 / 2**30)
    assert not any("reference" in p.what or "actor master" in p.what for p in parts), "no reference copy, no base masters"


def test_sharded_lora_plans_shards_of_the_base_and_adapters_and_a_full_merged_engine_copy(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "actor_rollout_ref.model.lora_rank=8",
                               "trainer.n_gpus_per_node=2"])
    parts = memory.plan(cfg, N, CUDA, need_ref=True, critic_params=None, lathe_engine=True, world=2,
                        lora=(20_000_000, 800_000_000))
    assert _gib(parts, "actor base weights (frozen), bf16, 1/2 shard") == pytest.approx(N / 2**30)
    assert _gib(parts, "actor LoRA adapters AdamW moments, 2 x fp32, 1/2 shard") == pytest.approx(4 * 20e6 / 2**30)
    assert _gib(parts, "rollout merged weights, bf16") == pytest.approx(2 * N / 2**30)   # the engine's own copy
    assert not any("reference" in p.what for p in parts)


def test_sharded_optimizer_offload_alone_puts_each_ranks_moments_in_host_memory(monkeypatch):
    """FSDP2 with optimizer_offload and not param_offload (OffloadedAdamW): the moments' shards count as host memory,
    the masters' shards stay on the device."""
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=2",
                               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=2)
    moments = next(p for p in parts if p.what.startswith("actor AdamW moments"))
    assert moments.what.endswith("1/2 shard") and moments.nbytes == 4 * N
    assert not moments.on_gpu and moments.why == "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"
    assert next(p for p in parts if p.what.startswith("actor master weights")).on_gpu


@pytest.mark.parametrize("world,keys,per_element", [
    (1, ("optimizer_offload",), 8),                    # MasterAdamW: the two fp32 moments stream
    (1, ("param_offload",), 12),                       # ... and its fp32 masters with them
    (2, ("optimizer_offload",), 8),                    # OffloadedAdamW on the FSDP2 shards: the moments
    (2, ("optimizer_offload", "param_offload"), 0),    # FSDP2's offload policy steps on the CPU: nothing streams
    (1, (), 0)])
def test_a_streamed_optimizer_step_counts_its_two_chunks_of_device_buffers(monkeypatch, world, keys, per_element):
    """StreamedAdam holds two chunks (`CHUNK_NUMEL` elements each, or a smaller shard) of the streamed tensors on the
    device during the update, per rank (not divided by the shards)."""
    from lathe.train.master import CHUNK_NUMEL
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                               *(f"actor_rollout_ref.actor.fsdp_config.{k}=true" for k in keys)])
    for n in (N, CHUNK_NUMEL // 4):
        parts = memory.plan(cfg, n, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=world)
        buffers = [p for p in parts if "streamed optimizer step" in p.what]
        assert sum(p.nbytes for p in buffers) == 2 * min(CHUNK_NUMEL, n // world) * per_element
        assert all(p.on_gpu and p.update_only for p in buffers)


def test_a_streamed_step_holds_two_chunks_whatever_the_largest_tensor(monkeypatch):
    """MasterAdamW (one device) and OffloadedAdamW (FSDP2 shards) cut a tensor larger than a chunk across chunks: a
    7B's untied embedding and LM head (545M elements each, twice CHUNK_NUMEL) take no larger buffers than two
    chunks', for the actor and the critic alike."""
    from lathe.train.master import CHUNK_NUMEL
    monkeypatch.setattr(memory, "total_memory", lambda device: int(140 * 2**30))
    big = 152064 * 3584
    n = 7_600_000_000
    assert big > CHUNK_NUMEL

    def buffers(world):
        cfg = load_config("base", ["trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                                   "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                                   "critic.model.fsdp_config.optimizer_offload=true"])
        parts = memory.plan(cfg, n, CUDA, need_ref=False, critic_params=n - big, lathe_engine=True, world=world)
        return {p.what.split()[0]: p.nbytes for p in parts if "streamed optimizer step" in p.what}

    assert buffers(1) == buffers(2) == {"actor": 2 * CHUNK_NUMEL * 8, "critic": 2 * CHUNK_NUMEL * 8}
    cfg = load_config("base", ["trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    parts = memory.plan(cfg, n, torch.device("cpu"), need_ref=False, critic_params=None, lathe_engine=True)
    assert not any("streamed" in p.what for p in parts), "a CPU run offloads nothing (offload_flags), streams nothing"


@pytest.mark.parametrize("world,key", [(1, "param_offload"), (2, "param_offload"), (2, "offload_policy")])
def test_parameter_offload_puts_the_moments_in_host_memory_too(monkeypatch, world, key):
    """The moments follow the offloaded parameters: MasterAdamW keeps them by its host masters (one device), FSDP2's
    offload policy keeps every shard's optimizer state with the shard (several). Counted on the GPU, a run that fits
    was refused, with optimizer_offload=true (which changes nothing then) named as the fix."""
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                               f"actor_rollout_ref.actor.fsdp_config.{key}=true"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=world)
    why = f"actor_rollout_ref.actor.fsdp_config.{key}=true"
    for what in ("actor master weights", "actor AdamW moments"):
        part = next(p for p in parts if p.what.startswith(what))
        assert not part.on_gpu and part.why == why, what
    text, _ = memory.format_plan(parts, CUDA, 0.5)
    assert "optimizer_offload=true saves" not in text


@pytest.mark.parametrize("world,key", [(1, "param_offload"), (2, "param_offload"), (2, "offload_policy")])
def test_fsdp2s_offload_policy_keeps_the_gradient_shards_and_the_references_in_host_memory(monkeypatch, world, key):
    """On several devices param_offload / offload_policy is FSDP2's offload policy: gradient shards (and a frozen
    reference's shards) live in host memory too; on one device MasterAdamW accumulates the gradients on the GPU."""
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", f"trainer.n_gpus_per_node={world}",
                               f"actor_rollout_ref.actor.fsdp_config.{key}=true",
                               f"actor_rollout_ref.ref.fsdp_config.{key}=true"])
    parts = memory.plan(cfg, N, CUDA, need_ref=True, critic_params=None, lathe_engine=True, world=world)
    grads = next(p for p in parts if p.what.startswith("actor gradients"))
    ref = next(p for p in parts if p.what.startswith("reference weights"))
    assert grads.on_gpu == (world == 1)
    assert not ref.on_gpu and ref.why == f"actor_rollout_ref.ref.fsdp_config.{key}=true"
    if world > 1:
        assert grads.why == f"actor_rollout_ref.actor.fsdp_config.{key}=true"


def test_hybrid_sharding_divides_each_model_by_its_shard_group_not_the_world(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=4"])
    parts = memory.plan(cfg, N, CUDA, need_ref=True, critic_params=N, lathe_engine=True, world=4,
                        shards={"actor": 2, "ref": 4, "critic": 1})    # HSDP 2 x 2; FSDP over 4; whole copies
    assert _gib(parts, "actor master weights, fp32, 1/2 shard") == pytest.approx(4 * N / 2 / 2**30)
    assert _gib(parts, "actor AdamW moments, 2 x fp32, 1/2 shard") == pytest.approx(8 * N / 2 / 2**30)
    assert _gib(parts, "reference weights, bf16, 1/4 shard") == pytest.approx(2 * N / 4 / 2**30)
    assert _gib(parts, "critic AdamW moments, 2 x fp32") == pytest.approx(8 * N / 2**30)
    assert not any(p.what.startswith("critic") and "shard" in p.what for p in parts)
    assert _gib(parts, "rollout weights, bf16") == pytest.approx(2 * N / 2**30)


def test_a_cpu_run_gets_one_line_for_a_small_model_and_the_table_from_one_gib():
    cfg, cpu = load_config("base", ["trainer.device=cpu"]), torch.device("cpu")
    small = memory.plan(cfg, 600_000, cpu, need_ref=False, critic_params=None, lathe_engine=True)
    text, fits = memory.format_plan(small, cpu, 0.5)
    assert fits and text == ("memory plan on cpu: 9.2 MiB of host memory for weights, gradients and optimizer state "
                             "(before activations)")
    text, fits = memory.format_plan(memory.plan(cfg, N, cpu, need_ref=False, critic_params=None, lathe_engine=True),
                                    cpu, 0.5)
    lines = text.splitlines()
    assert fits and lines[0] == "memory plan on cpu: 14.90 GiB of host memory before activations:"
    assert len(lines) == 4 and lines[1].split()[:2] == ["actor", "weights,"] and lines[1].endswith("3.73 GiB")


def test_a_tensor_parallel_rank_holds_its_share_of_the_rollout_weights(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=4",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=4)
    rollout = next(p for p in parts if p.what.startswith("rollout weights"))
    assert rollout.nbytes == 2 * N // 2 and rollout.what.endswith("1/2 of a replica")      # bf16, half a replica
    assert _gib(parts, "actor master weights") == pytest.approx(4 * N / 4 / 2**30)          # fp32, 1/4 shard
    # the embeddings (here 1/10 of the weights) whole on each rank, and a tied model's LM head as a slice besides
    for tied, share in ((False, 0.9 / 2 + 0.1), (True, 0.9 / 2 + 0.1 + 0.1 / 2)):
        parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=4,
                            embeddings=(N // 10, tied))
        rollout = next(p for p in parts if p.what.startswith("rollout weights"))
        assert rollout.nbytes == pytest.approx(2 * N * share, rel=1e-6), tied


def test_data_parallel_attention_spreads_the_experts_over_the_engine(monkeypatch):
    """D=2 replicas of TP=2 with data-parallel attention: the routed experts (here 3/4 of the weights) over the
    engine's 4 ranks, the rest over a replica's 2."""
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=4",
                               "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                               "actor_rollout_ref.rollout.data_parallel_size=2",
                               "actor_rollout_ref.rollout.expert_parallel_size=4"])
    parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=4,
                        engine_experts=(3 * N // 4, 2))
    rollout = next(p for p in parts if p.what.startswith("rollout weights"))
    assert rollout.nbytes == pytest.approx(2 * (N / 4 / 2 + 3 * N / 4 / 4), rel=1e-6)      # bf16
    assert rollout.what.endswith("1/2 of a replica and 1/4 of its experts")


def test_a_run_that_does_not_fit_names_the_layouts_that_would_hold_less(monkeypatch):
    monkeypatch.setattr(memory, "total_memory", lambda device: 16 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=4",
                               "actor_rollout_ref.actor.fsdp_config.fsdp_size=2"])
    parts = memory.plan(cfg, 4 * N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=4,
                        shards={"actor": 2})
    fixes = memory.mesh_fixes(parts, rollout_tp=1, world=4, per_node=4,
                              fsdp_sizes={"actor_rollout_ref.actor.fsdp_config.fsdp_size": 2})
    assert fixes[0].startswith("actor_rollout_ref.rollout.tensor_model_parallel_size=2 saves 3.7 GiB")
    assert fixes[1].startswith("actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 shards that model over all 4")
    text, fits = memory.format_plan(parts, CUDA, 0.5, mesh_fixes=fixes)
    assert not fits and "tensor_model_parallel_size=2 saves" in text and "fsdp_size=-1" in text
    assert memory.mesh_fixes(parts, rollout_tp=4, world=4, per_node=4, fsdp_sizes={}) == []    # no wider replica


def test_weights_kept_gathered_across_micro_batches_are_planned_where_auto_turns_them_on(monkeypatch):
    """fsdp_config.keep_gathered (lathe.train.gathered): on 2 ranks the whole bf16 weights + fp32 gradients (6 bytes a
    parameter) join the update where auto turns it on (at most 15% of the device), never when it is off."""
    for gib, on in ((80.0, True), (24.0, False)):           # 5.6 GiB: 7% of 80 GiB, 23% of 24 GiB
        monkeypatch.setattr(memory, "total_memory", lambda device, gib=gib: int(gib * 2**30))
        for setting, want in (("null", on), ("false", False), ("true", True)):
            cfg = load_config("base", ["trainer.device=cpu",
                                       f"actor_rollout_ref.actor.fsdp_config.keep_gathered={setting}"])
            parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=2)
            kept = [p for p in parts if "keep_gathered" in p.what]
            assert bool(kept) == want, (gib, setting)
            assert not kept or (kept[0].nbytes == 6 * N and kept[0].update_only)


# -- the other models: reward model, judge, distillation teachers (sized from config.json alone) ----------------
H, I, L, V = 32, 64, 2, 100                   # tiny Llama: 4 heads of 8, 2 KV heads (KV width 16), untied head
LAYER = H * H + 2 * H * 16 + H * H + 3 * H * I + 2 * H          # q, k, v, o, gate/up/down, two norms
CAUSAL = V * H + L * LAYER + H + V * H                           # embeddings, layers, final norm, lm_head: 24,992
CLASSIFIER = CAUSAL - V * H + H                                  # the lm_head replaced by a one-label score row


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny Llama checkpoint directory holding config.json only (the plan reads no weight)."""
    from transformers import LlamaConfig
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(path)
    return str(path)


def _other(overrides, monkeypatch, *, world=1, shards=None):
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    cfg = load_config("base", ["trainer.device=cpu", *overrides])
    parts = other_model_parts(cfg, CUDA, world=world, shards=shards)
    assert all(p.what.startswith(("reward model", "judge", "teacher")) for p in parts)
    return parts


@pytest.mark.parametrize("offload", [False, True])
def test_the_reward_model_is_a_whole_bf16_copy_on_the_device_or_in_host_memory(tiny_ckpt, monkeypatch, offload):
    key = "reward_model.model.fsdp_config.param_offload"
    (rm,) = _other(["reward_model.enable=true", f"reward_model.model.path={tiny_ckpt}", f"{key}={offload}"],
                   monkeypatch, world=2)
    assert rm.what == "reward model weights, bf16, whole on each rank" and rm.nbytes == 2 * CLASSIFIER
    assert rm.on_gpu is not offload and rm.offload_key == key and (key in rm.why) is offload


# a rollout pool of its own (fully-async training): the reward model's and the teachers' pools beside it
ROLLOUT_POOL = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false", "data.train_batch_size=0"]


@pytest.mark.parametrize("rollout_pool", [[], ROLLOUT_POOL], ids=["sync", "fully_async"])
def test_a_reward_model_on_a_pool_of_its_own_is_not_on_the_trainers_devices(tiny_ckpt, monkeypatch, rollout_pool):
    for judge in ("false", "true"):
        assert _other(["reward_model.enable=true", f"reward_model.model.path={tiny_ckpt}",
                       f"reward_model.judge.enable={judge}", "reward_model.enable_resource_pool=true",
                       "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1", *rollout_pool], monkeypatch) == []


@pytest.mark.parametrize("offload", [False, True])
def test_the_judge_plans_its_weights_and_says_its_kv_cache_is_sized_at_start_up(tiny_ckpt, monkeypatch, offload):
    key = "reward_model.model.fsdp_config.param_offload"
    weights, cache = _other(["reward_model.enable=true", f"reward_model.model.path={tiny_ckpt}",
                             "reward_model.judge.enable=true", "reward_model.rollout.enforce_eager=true",
                             f"{key}={offload}"], monkeypatch)
    assert weights.what == "judge weights, bf16, whole on each rank" and weights.nbytes == 2 * CAUSAL
    assert weights.on_gpu is not offload and weights.offload_key == key and (key in weights.why) is offload
    assert cache.nbytes == 0 and "not known up front" in cache.what and "free_cache_engine=true" in cache.why


@pytest.mark.parametrize("offload", [False, True])
def test_each_teacher_is_placed_like_the_reference(tiny_ckpt, monkeypatch, offload):
    key = "actor_rollout_ref.ref.fsdp_config.param_offload"
    d = "distillation.teacher_models"
    two = ["distillation.enabled=true", f"+{d}.a.key=x", f"+{d}.a.model_path={tiny_ckpt}", f"+{d}.b.key=y",
           f"+{d}.b.model_path={tiny_ckpt}", f"{key}={offload}"]
    a, b = _other(two, monkeypatch)
    assert (a.what, b.what) == ("teacher a weights, bf16", "teacher b weights, bf16")
    assert a.nbytes == b.nbytes == 2 * CAUSAL and a.on_gpu is not offload and a.offload_key == key
    (sharded,) = _other(["distillation.enabled=true", f"{d}.teacher_model.model_path={tiny_ckpt}",
                         f"{key}={offload}"], monkeypatch, world=4, shards={"ref": 2})
    assert sharded.what == "teacher teacher_model weights, bf16, 1/2 shard" and sharded.nbytes == CAUSAL
    assert sharded.on_gpu is not offload


@pytest.mark.parametrize("rollout_pool", [[], ROLLOUT_POOL], ids=["sync", "fully_async"])
def test_teachers_on_a_pool_of_their_own_are_not_on_the_trainers_devices(tiny_ckpt, monkeypatch, rollout_pool):
    assert _other(["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={tiny_ckpt}",
                   "distillation.nnodes=1", "distillation.n_gpus_per_node=1", *rollout_pool], monkeypatch) == []


def test_a_model_whose_config_cannot_be_built_is_named_with_its_size_unknown(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    (rm,) = _other(["reward_model.enable=true", f"reward_model.model.path={tmp_path}"], monkeypatch)
    assert rm.nbytes == 0 and f"size not known up front (reward_model.model.path={tmp_path}: " in rm.what


def test_a_vision_language_teacher_counts_its_vision_tower(tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    from models.vl_tiny import hf_config
    config = hf_config("qwen2_5_vl")
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):                     # the reference: transformers' own model of that config
        want = memory.count_params(AutoModelForImageTextToText.from_config(config))
    (teacher,) = _other(["distillation.enabled=true",
                         f"distillation.teacher_models.teacher_model.model_path={tmp_path}"], monkeypatch)
    assert teacher.nbytes == 2 * want and "not known" not in teacher.what


def test_pinned_parts_beyond_the_hosts_memory_are_refused_with_the_keys_that_put_them_there(monkeypatch):
    """Pinned host memory cannot be swapped: offloaded parts of the node's ranks beyond 90% of the host's memory are
    refused up front (the kernel would kill the run mid-way), naming the keys; beyond what is available now, said."""
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=2",
                               "actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    parts = memory.plan(cfg, 10 * N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=2)
    pinned = sum(p.nbytes for p in parts if not p.on_gpu)                      # a rank's: ~56 GiB at 10B over 2
    gib = 2**30
    text, fits = memory.format_plan(parts, CUDA, 0.5, host_ranks=2, host_memory=(1000 * gib, 900 * gib))
    assert fits and "DOES NOT FIT" not in text and "short" not in text and f"{2 * pinned / gib:.2f} GiB for the 2" in text
    text, fits = memory.format_plan(parts, CUDA, 0.5, host_ranks=2, host_memory=(1000 * gib, int(1.5 * pinned)))
    assert fits and "host memory is short" in text
    text, fits = memory.format_plan(parts, CUDA, 0.5, host_ranks=2, host_memory=(int(2 * pinned / 0.95), None))
    assert not fits and "DOES NOT FIT in host memory" in text
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=true" in text.split("DOES NOT FIT in host memory")[1]
    assert memory.format_plan(parts, CUDA, 0.5, host_ranks=1, host_memory=(int(2 * pinned / 0.95), None))[1]
    assert memory.format_plan(parts, CUDA, 0.5, host_ranks=2)[1]                 # (unknown: not checked)


def test_pinned_rounding_counts_each_tensors_block_up_to_a_power_of_two():
    assert memory.pinned_rounding([1 << 20, 3, 0, 5 << 20], 4) == 0 + (16 - 12) + 0 + ((32 << 20) - (20 << 20))
    total, available = memory.host_memory()
    assert total > 0 and (available is None or 0 < available <= total)


def test_the_start_up_plan_counts_the_host_masters_rounding_and_refuses_what_the_host_cannot_pin(make_lathe,
                                                                                                monkeypatch):
    """`lathe train`'s plan on one GPU with param_offload: MasterAdamW's host masters are pinned a block each, which
    torch rounds up to a power of two (counted), and a host too small for what is pinned is refused before anything
    reaches the GPU."""
    from lathe.config import run_plan
    from lathe.loop.setup import log_memory_plan
    model = make_lathe()
    cfg = load_config("base", ["trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                               "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32"])
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    params = [p.numel() for p in model.parameters()]
    rounding = memory.pinned_rounding(params, 4)
    pinned = 3 * 4 * sum(params) + rounding                    # masters, two moments (fp32), the masters' rounding
    assert rounding > 0
    monkeypatch.setattr(memory, "host_memory", lambda: (int(pinned / 0.95), None))
    with pytest.raises(ValueError, match="DOES NOT FIT in host memory") as info:
        log_memory_plan(cfg, run_plan(cfg), model, CUDA)
    assert "pinned rounding" in str(info.value) and "param_offload=true" in str(info.value)
    monkeypatch.setattr(memory, "host_memory", lambda: (int(pinned / 0.85), None))
    log_memory_plan(cfg, run_plan(cfg), model, CUDA)


def test_auto_data_parallel_attention_takes_replicas_of_whole_experts_where_they_fit(monkeypatch):
    """`rollout.data_parallel_attention=auto`: on a GPU, an engine of data-parallel attention runs as replicas of whole
    experts (expert_parallel_size = TP: what the engine and the driver read) where the replicas' plan holds the step's
    KV cache beside their weights; always keeps it, and so do CPU runs and plans without that room."""
    from lathe.config import run_plan
    from lathe.loop.setup import auto_replicas, log_memory_plan
    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hf_model
    model = lathe_from_transformers(hf_model("qwen3_moe"))
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    dp = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.data_parallel_size=2",
          "actor_rollout_ref.rollout.expert_parallel_size=2"]
    for setting, device, ep in (("auto", CUDA, 1), ("always", CUDA, 2), ("auto", torch.device("cpu"), 2)):
        cfg = load_config("base", [*dp, f"actor_rollout_ref.rollout.data_parallel_attention={setting}"],
                          device_count=2)
        log_memory_plan(cfg, run_plan(cfg), model, device)
        assert cfg.actor_rollout_ref.rollout.expert_parallel_size == ep, (setting, device)
    # the replicas' weights leave 40 - 30 = 10 GiB of KV cache (sequences of 1 GiB): they run for steps of up to 10
    # sequences, all that data-parallel attention's plan would run at once; else it stays
    kv = 2**30
    replicas = [memory.Part("rollout weights", 30 * 2**30, True), memory.Part("gradients", 40 * 2**30, True, True)]
    spread = [memory.Part("rollout weights", 10 * 2**30, True)]                  # 30 GiB of KV cache: 30 sequences
    cfg = load_config("base", dp, device_count=2)
    for fits, seqs, want in ((True, 9, True), (True, 10, True), (True, 11, False), (True, 30, False),
                             (False, 10, False)):
        assert auto_replicas(cfg, (replicas, fits), spread, CUDA, kv, seqs) == want, (fits, seqs)
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 1                # (the first one took them)
    for spread_gib, want in ((30, True), (29, False)):          # data-parallel attention holds 10, or 11 of the 30
        cfg = load_config("base", dp, device_count=2)
        spread = [memory.Part("rollout weights", spread_gib * 2**30, True)]
        assert auto_replicas(cfg, (replicas, True), spread, CUDA, kv, 30) == want, spread_gib
    cfg = load_config("base", dp, device_count=2)
    assert not auto_replicas(cfg, (replicas, True), spread, torch.device("cpu"), kv, 10)     # CPU runs keep it
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 2


def test_data_parallel_attention_always_is_refused_where_the_model_runs_replicas(monkeypatch, make_lathe):
    """`data_parallel_attention=always` with a model that runs verl's layout as replicas anyway (a dense model here):
    refused at start-up, not ignored."""
    from lathe.config import run_plan
    from lathe.loop.setup import log_memory_plan
    monkeypatch.setattr(memory, "total_memory", lambda device: int(80 * 2**30))
    cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=2",
                               "actor_rollout_ref.rollout.data_parallel_size=2",
                               "actor_rollout_ref.rollout.expert_parallel_size=2",
                               "actor_rollout_ref.rollout.data_parallel_attention=always"], device_count=2)
    with pytest.raises(ValueError, match="has no mixture-of-experts layers, so its engine runs as replicas"):
        log_memory_plan(cfg, run_plan(cfg), make_lathe(), CUDA)


def test_fsdp2_shards_under_mixed_precision_hold_no_compute_copy(monkeypatch):
    """On several ranks FSDP2 computes in bf16 on the fp32 shards, cast as each layer is gathered: the plan counts the
    fp32 masters (1/world), no bf16 shard beside them (a phantom that cost the 30B-A3B run 7.5 GiB of planned KV
    cache); pure bf16 training shards its bf16 weights."""
    monkeypatch.setattr(memory, "total_memory", lambda device: 80 * 2**30)
    for dtype, weights in (("fp32", False), ("bf16", True)):
        cfg = load_config("base", ["trainer.device=cpu", "trainer.n_gpus_per_node=2",
                                   f"actor_rollout_ref.actor.fsdp_config.model_dtype={dtype}"], device_count=2)
        parts = memory.plan(cfg, N, CUDA, need_ref=False, critic_params=None, lathe_engine=True, world=2)
        names = [p.what for p in parts]
        assert any(n.startswith("actor weights") for n in names) == weights, names
        assert any(n.startswith("actor master weights, fp32") for n in names) != weights, names
        if not weights:
            assert _gib(parts, "actor master weights, fp32") == pytest.approx(4 * N / 2 / 2**30)


def test_another_optimizers_state_is_counted_and_only_offloads_it_can_take_are_suggested(monkeypatch):
    """SGD with momentum keeps one fp32 buffer a parameter (counted by one step on a small tensor); on one device
    nothing offloads it (lathe offloads its own AdamW only), so no offload key is suggested for its masters or state."""
    sgd = ["actor_rollout_ref.actor.optim.optimizer=SGD", "+actor_rollout_ref.actor.optim.override_optimizer_config."
           "momentum=0.9"]
    parts, text, fits = _plan(*sgd, total_gib=16.0, monkeypatch=monkeypatch)
    assert _gib(parts, "actor SGD state, 1 x fp32") == pytest.approx(4 * N / 2**30)
    assert not any("moments" in p.what for p in parts if p.what.startswith("actor"))
    assert "actor_rollout_ref.actor.fsdp_config" not in text, "no offload key acts on another optimizer on one device"
    plain, _, _ = _plan("actor_rollout_ref.actor.optim.optimizer=SGD", monkeypatch=monkeypatch)
    assert _gib(plain, "actor SGD state, none") == 0
    amsgrad, _, _ = _plan("+actor_rollout_ref.actor.optim.override_optimizer_config.amsgrad=true",
                          monkeypatch=monkeypatch)
    assert _gib(amsgrad, "actor AdamW state, 3 x fp32") == pytest.approx(12 * N / 2**30)
