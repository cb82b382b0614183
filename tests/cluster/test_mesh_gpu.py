"""The trainer's and the engine's parallel layouts on 2 GPUs over NCCL (lathe issue 43), each against the one-GPU run of
the same tiny model and data, bf16 compute on fp32 masters: tensor parallelism, Ulysses sequence parallelism, expert
parallelism (a tiny Qwen3-MoE), LoRA under tensor parallelism, a tiny Qwen3.5 (linear attention) under tensor
parallelism, a tensor-parallel rollout replica in the synchronous loop, an engine of two replicas with data-parallel
attention, and the fully asynchronous loop on 1 trainer GPU + 1 rollout GPU against the synchronous loop; on 4 GPUs,
TP 2 x EP 4 (the experts over both tensor-parallel groups) for the actor and the reference.

Their CPU twins (gloo, fp32, within 1e-5) are tests/train/test_tensor_parallel.py (and _hybrid.py), test_ulysses.py,
test_expert_parallel.py, test_tensor_parallel_lora.py, tests/cluster/test_ray.py (the replica),
test_data_parallel_ray.py and test_fully_async.py; plain FSDP over 2 GPUs is test_ray_gpu.py and LoRA under plain FSDP2 test_lora_fsdp2_gpu.py.
On GPUs the two sides reduce bf16 sums in other orders, so the update's metrics agree to ~1e-2 (test_ray_gpu.py's
tolerances and floors), not 1e-5; where the layout leaves the rollout alone (a trainer layout: each GPU's engine
samples its share) the step-1 samples are the same and so are their scores. Each case is a function of the device type
(`trainer.device`): on CPU the same functions run over gloo on 2 Ray workers (how this module was checked on a machine
without GPUs); here they run on CUDA. Run on a host of 2+ GPUs:

    PYTHONPATH=src:tests python -m pytest -q -m gpu tests/cluster/test_mesh_gpu.py
"""

from __future__ import annotations

import math

import pytest
import yaml

from helpers import needs_gpus

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from cluster.test_fully_async import ON_POLICY, POOLS  # noqa: E402
from cluster.test_lora_ray import OVERRIDES as LORA  # noqa: E402
from cluster.test_ray import train  # noqa: E402
from loop.test_ppo import qwen3_moe_checkpoint  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_gpus(2)]

A = "actor_rollout_ref.actor"
# test_lora_ray's adapter keys, not its model (builtin:tiny not warm-started: scores, advantages and gradients all 0) or
# its batch and device keys
LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "use_kl_loss", "lr")
TP = f"{A}.fsdp_config.tensor_parallel_size=2"
TWO = "trainer.n_gpus_per_node=2"
STEPS = "trainer.total_training_steps=2"
UPDATE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")
REL = 2e-2      # bf16 reductions in another order (test_ray_gpu.py, test_lora_fsdp2_gpu.py: within ~1e-2)
# pg_loss averages unit-scale advantages times ratios near 1 and is itself near 0: its bf16 noise is absolute
FLOORS = {"actor/pg_loss": 0.25}


SHOWN = (*UPDATE, "critic/score/mean", "response_length/mean", "training/rollout_probs_diff_mean",
         "training/rollout_probs_diff_max")


def shown(one: dict, many: dict) -> str:
    """Both runs' step side by side (what a failure report must keep: a GPU run's files do not survive it)."""
    return f"step {one.get('step')}: " + ", ".join(f"{k} {one.get(k)!r} / {many.get(k)!r}" for k in SHOWN)


def assert_near(one: dict, many: dict, keys=UPDATE) -> None:
    """Each of `keys` of `many`'s step within REL of `one`'s, relative to max(|one's|, its floor: 1e-2 unless FLOORS
    says)."""
    for key in keys:
        tol = REL * max(abs(one[key]), FLOORS.get(key, 1e-2))
        assert abs(many[key] - one[key]) <= tol, (key, shown(one, many))


def assert_synced(one: list[dict], many: list[dict]) -> None:
    """Both runs trained 2 steps, every metric finite; `many`'s engine held its trainer's weights at each step: the
    trainer's log-probs of the engine's samples within bf16 noise of them, as near as one device's are (a sync that
    lost or mis-cut a tensor shows as a difference of order 1)."""
    assert len(one) == len(many) == 2
    for a, b in zip(one, many):
        bad = [k for k, v in b.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, f"step {b.get('step')}: not finite: {bad}"
        key = "training/rollout_probs_diff_mean"            # the mean: the max of bf16 noise is itself noisy
        assert b[key] <= 2 * a[key] + 1e-3, (key, shown(a, b))


def assert_step1_alike(a: dict, b: dict) -> None:
    """Step 1 of two runs whose engines' bf16 sums may round apart (another batch split or layout): the same update
    within bf16 noise when they drew the same samples, else the same score and length statistics."""
    if (b["critic/score/mean"], b["response_length/mean"]) == (a["critic/score/mean"], a["response_length/mean"]):
        assert_near(a, b)
    else:
        assert abs(b["critic/score/mean"] - a["critic/score/mean"]) <= 0.05, shown(a, b)
        assert abs(b["response_length/mean"] - a["response_length/mean"]) <= 0.05 * a["response_length/mean"], \
            shown(a, b)


def trainer_layout(root, device: str, layout: tuple[str, ...], base: tuple[str, ...] = (), *,
                   exact_samples: bool = True) -> None:
    """`base` on one device and on 2 with the trainer's `layout` (the rollout unchanged: one engine per device): the
    same samples at step 1 and the same update within bf16 noise; the engines synced at both steps. Without
    `exact_samples`, step 1 is compared as `assert_step1_alike` does."""
    one = train(root / "one", f"trainer.device={device}", STEPS, *base)
    many = train(root / "many", f"trainer.device={device}", STEPS, TWO, *base, *layout)
    if exact_samples:                                                          # the same samples at step 1
        assert many[0]["critic/score/mean"] == one[0]["critic/score/mean"], shown(one[0], many[0])
        assert many[0]["response_length/mean"] == one[0]["response_length/mean"], shown(one[0], many[0])
        assert_near(one[0], many[0])
    else:
        assert_step1_alike(one[0], many[0])
    assert_synced(one, many)


def tensor_parallel(root, device: str) -> None:
    """The actor's decoder layers, embeddings and vocabulary cut over the 2 devices (`fsdp_config.tensor_parallel_size`:
    column/row-parallel projections, vocabulary-parallel log-probs and entropy)."""
    trainer_layout(root, device, (TP,))


def ulysses(root, device: str) -> None:
    """One Ulysses group of 2 (`ulysses_sequence_parallel_size`): each device holds half of each packed micro-batch's
    tokens and all-to-alls them into half of the heads for attention."""
    trainer_layout(root, device, (f"{A}.ulysses_sequence_parallel_size=2",),
                   ("actor_rollout_ref.model.use_remove_padding=true",))


FP32 = (f"{A}.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32", "actor_rollout_ref.rollout.dtype=float32")


def expert_parallel(root, device: str) -> None:
    """A tiny Qwen3-MoE (tests/loop/test_ppo.py's: 4 experts, top-2, its second layer sparse), warm-started so that its
    scores and advantages are not all 0, with 2 whole experts on each device (`fsdp_config.expert_parallel_size`:
    tokens dispatched by all-to-all), computed in fp32 (actor, reference and engine) and so compared as closely as on
    CPU: in bf16 this model's first update is ill-conditioned (a gradient norm of ~34, ~0.3 at step 2), and its norm
    came out 2.5% apart on 2 H200s (2026-11-30: 34.38 against 35.26) while the fp32 run agreed to 6e-7 (34.622133
    against 34.622152); `moe_plain_fsdp` keeps the bf16 comparison."""
    one = train(root / "one", f"trainer.device={device}", STEPS, *moe_model(root), *FP32)
    many = train(root / "many", f"trainer.device={device}", STEPS, TWO, *moe_model(root), *FP32,
                 f"{A}.fsdp_config.expert_parallel_size=2")
    for a, b in zip(one, many, strict=True):
        assert (b["critic/score/mean"], b["response_length/mean"]) == (a["critic/score/mean"],
                                                                      a["response_length/mean"]), shown(a, b)
        for key in UPDATE:
            assert abs(b[key] - a[key]) <= 1e-4 * max(abs(a[key]), 1e-2), (key, shown(a, b))
    assert_synced(one, many)


def tp_ep_over_groups(root, device: str) -> None:
    """4 devices: the actor and the reference (GRPO with the KL loss) under TP 2 x EP 4, the experts over both
    tensor-parallel groups (one a device; each device of a group dispatching half its group's rows), a tiny
    Qwen3-MoE with 2 key/value heads, fp32 as `expert_parallel`, against one device. On CPU (4 Ray workers over gloo,
    2026-12-02) scores, lengths and rollout gaps matched and the losses, gradient norms and entropy agreed to 1e-7."""
    model = qwen3_moe_checkpoint(root / "moe", kv_heads=2)
    base = (f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.tokenizer_path=builtin:tiny",
            "actor_rollout_ref.model.warm_start.steps=80", *FP32, f"{A}.use_kl_loss=true")
    sizes = [f"{role}.fsdp_config.{k}_parallel_size={n}" for role in (A, "actor_rollout_ref.ref")
             for k, n in (("tensor", 2), ("expert", 4))]
    one = train(root / "one", f"trainer.device={device}", STEPS, *base)
    many = train(root / "many", f"trainer.device={device}", STEPS, "trainer.n_gpus_per_node=4", *base, *sizes,
                 *("ray_kwargs.ray_init.num_cpus=4",) * (device == "cpu"))    # (four one-slot workers on CPU)
    for a, b in zip(one, many, strict=True):
        assert (b["critic/score/mean"], b["response_length/mean"]) == (a["critic/score/mean"],
                                                                      a["response_length/mean"]), shown(a, b)
        for key in (*UPDATE, "actor/kl_loss"):
            assert abs(b[key] - a[key]) <= 1e-4 * max(abs(a[key]), 1e-2), (key, shown(a, b))
    assert_synced(one, many)


def moe_plain_fsdp(root, device: str) -> None:
    """`expert_parallel`'s model in bf16 on 2 devices with plain FSDP2 (no expert parallelism), two engines of half the
    prompts each: the MoE model's bf16 path over 2 GPUs within bf16 noise of one (its samples compared loosely: bf16
    router ties between batches of other sizes). (The decode experts' path, chosen
    by timing, is one per machine since `lathe.engine.choices`: every engine of both runs takes the first one's.)"""
    trainer_layout(root, device, (), moe_model(root), exact_samples=device == "cpu")


def moe_model(root) -> tuple[str, ...]:
    """The overrides of `expert_parallel`'s tiny warm-started Qwen3-MoE."""
    model = qwen3_moe_checkpoint(root / "moe")
    return (f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.tokenizer_path=builtin:tiny",
            "actor_rollout_ref.model.warm_start.steps=80")


def hybrid_tensor_parallel(root, device: str) -> None:
    """A tiny Qwen3.5 (tests/loop/test_reward_rises_families.py's: a gated-DeltaNet layer, a gated full-attention
    one), warm-started, its layers cut over the 2 devices: the linear-attention layer's key and value heads split
    (`lathe.train.tensor_parallel`'s module doc), the engines handed the whole weights."""
    from loop.test_reward_rises_families import tiny_family_checkpoint
    model = tiny_family_checkpoint("qwen3_5_text", root / "qwen3_5")
    trainer_layout(root, device, (TP,), (f"actor_rollout_ref.model.path={model}",
                                         "actor_rollout_ref.model.tokenizer_path=builtin:tiny",
                                         "actor_rollout_ref.model.warm_start.steps=40"))


def lora_tensor_parallel(root, device: str) -> None:
    """LoRA adapters (tests/cluster/test_lora_ray.py's: q/v column-parallel, down row-parallel; the KL loss against
    the base model with the adapters off) under tensor parallelism 2, the engines handed the whole merged layers;
    against one device's LoRA."""
    base = tuple(o for o in LORA if any(f".{key}=" in o for key in LORA_KEYS))
    trainer_layout(root, device, (TP,), base)


def rollout_replica(root, device: str) -> None:
    """The 2 devices train as plain FSDP and generate as one tensor-parallel engine replica
    (`rollout.tensor_model_parallel_size`), synced from the trainer's whole weights. The replica's bf16 logits are
    its own sums' (rounded apart from one device's), so a sample may differ where two tokens' odds are near even:
    the step-1 samples are compared as the one device's when they are the same and by their statistics when not;
    the engine's log-probs of its samples are the trainer's within bf16 noise either way."""
    one = train(root / "one", f"trainer.device={device}", STEPS)
    many = train(root / "many", f"trainer.device={device}", STEPS, TWO,
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert_step1_alike(one[0], many[0])
    assert_synced(one, many)


def data_parallel_attention(root, device: str) -> None:
    """`expert_parallel`'s tiny Qwen3-MoE generated by one engine of 2 replicas with data-parallel attention
    (`rollout.data_parallel_size=2`, `expert_parallel_size=2`: each device its own prompts, 2 of the 4 experts, the
    rows of both gathered for them; `data_parallel_attention=always`, as auto would take replicas of whole experts for a
    model this small on GPUs), trained as plain FSDP2: the same samples as one device on CPU (fp32), alike on
    GPUs (bf16 sums of other batches); the engines synced at both steps."""
    trainer_layout(root, device, ("actor_rollout_ref.rollout.data_parallel_size=2",
                                  "actor_rollout_ref.rollout.expert_parallel_size=2",
                                  "actor_rollout_ref.rollout.data_parallel_attention=always"), moe_model(root),
                   exact_samples=device == "cpu")


def data_parallel_auto(root, device: str) -> None:
    """verl's layout of `data_parallel_attention` with lathe's default `rollout.data_parallel_attention=auto`: on GPUs
    the memory plan holds this tiny model's replicas of whole experts with the step's KV cache, so the driver runs
    them instead (expert_parallel_size 1 in the config.yaml the run writes: what the workers and the driver read),
    CUDA graphs captured, and the same run as one device's within bf16 noise; on CPU auto keeps data-parallel
    attention (expert_parallel_size 2)."""
    layout = ("actor_rollout_ref.rollout.data_parallel_size=2", "actor_rollout_ref.rollout.expert_parallel_size=2")
    one = train(root / "one", f"trainer.device={device}", STEPS, *moe_model(root))
    many = train(root / "many", f"trainer.device={device}", STEPS, TWO, *layout, *moe_model(root))
    assert_step1_alike(one[0], many[0])
    assert_synced(one, many)
    chosen = yaml.safe_load((root / "many" / "config.yaml").read_text())["actor_rollout_ref"]["rollout"]
    assert chosen["expert_parallel_size"] == (1 if device == "cuda" else 2), chosen["expert_parallel_size"]
    if device == "cuda":
        assert many[0]["rollout/graph_captures"] > 0, shown(one[0], many[0])


def fully_async(root, device: str) -> None:
    """Fully async on-policy (tests/cluster/test_fully_async.py's keys: staleness 0, a sync after every update) with
    the trainer on one device and the rollout replica on another, the new weights sent over the checkpoint engine
    (NCCL between the two GPUs), against the synchronous loop on one device: the same samples at step 1 and the same
    update within bf16 noise; no sample stale or partial, and the engine's log-probs the trainer's within bf16 noise
    at each step (the weights arrived). A tensor-parallel replica (the resharding sync) needs 2 rollout devices
    beside the trainer's: not on 2 GPUs."""
    sync = train(root / "sync", f"trainer.device={device}", STEPS)
    on_policy = train(root / "async", f"trainer.device={device}", STEPS, *POOLS, *ON_POLICY)
    assert on_policy[0]["critic/score/mean"] == sync[0]["critic/score/mean"]
    assert_near(sync[0], on_policy[0], ("actor/pg_loss", "actor/grad_norm"))
    assert_synced(sync, on_policy)
    for b in on_policy:
        assert b["fully_async/staleness/max"] == 0 and b["fully_async/partial/total_partial_num"] == 0
        assert b["fully_async/rollout_probs_diff_current_max"] == b["training/rollout_probs_diff_max"]


def fully_async_lora(root, device: str) -> None:
    """`fully_async` with LoRA adapters (`lora_tensor_parallel`'s): each sync sends the adapted layers' merged
    weights only, over the checkpoint engine (NCCL between the two GPUs), and the replica loads them over its base
    model; against the synchronous LoRA loop on one device (its CPU twin, on 2 sharded trainer ranks with DAPO's
    dynamic sampling: tests/cluster/test_fully_async.py)."""
    lora = tuple(o for o in LORA if any(f".{key}=" in o for key in LORA_KEYS))
    sync = train(root / "sync", f"trainer.device={device}", STEPS, *lora)
    on_policy = train(root / "async", f"trainer.device={device}", STEPS, *lora, *POOLS, *ON_POLICY)
    assert on_policy[0]["critic/score/mean"] == sync[0]["critic/score/mean"]
    assert_near(sync[0], on_policy[0], ("actor/pg_loss", "actor/grad_norm"))
    assert_synced(sync, on_policy)
    for b in on_policy:
        assert b["fully_async/staleness/max"] == 0 and 0 < b["fully_async/sync/fraction_of_full"] < 0.5, shown({}, b)


def fully_async_data_parallel(root, device: str) -> None:
    """Fully async on-policy (`fully_async`'s keys) with a rollout pool of 2 devices that form one engine of
    data-parallel attention (`data_parallel_attention`'s tiny Qwen3-MoE: each replica its own requests and 2 of the 4
    experts, their engine threads agreeing every tick) beside 1 trainer device, the new weights sent whole to both:
    against the synchronous loop on one device, the same samples and updates on CPU (1e-5), alike within bf16 noise on
    GPUs; nothing stale or partial, and the replicas' log-probs the trainer's at every step (each rank's experts its
    own). 3 devices."""
    from cluster.test_ray import assert_same
    base = (f"trainer.device={device}", STEPS, *moe_model(root))
    sync = train(root / "sync", *base)
    on_policy = train(root / "async", *base, *ON_POLICY, "rollout.n_gpus_per_node=2",
                      "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.data_parallel_size=2",
                      "actor_rollout_ref.rollout.expert_parallel_size=2",
                      "actor_rollout_ref.rollout.data_parallel_attention=always",
                      "ray_kwargs.ray_init.num_cpus=4")      # (on CPU: three one-slot workers of the shared cluster)
    if device == "cpu":
        for a, b in zip(sync, on_policy):
            assert_same(a, b)
    else:
        assert_step1_alike(sync[0], on_policy[0])
    assert_synced(sync, on_policy)
    for b in on_policy:
        assert b["fully_async/staleness/max"] == 0 and b["fully_async/partial/total_partial_num"] == 0
        assert b["fully_async/rollout_probs_diff_current_max"] == b["training/rollout_probs_diff_max"]
        if device == "cpu":
            assert b["training/rollout_probs_diff_max"] < 1e-4


CASES = {f.__name__: f for f in (tensor_parallel, ulysses, expert_parallel, moe_plain_fsdp, lora_tensor_parallel,
                                 hybrid_tensor_parallel, rollout_replica, data_parallel_attention, data_parallel_auto,
                                 fully_async, fully_async_lora)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_on_two_gpus_trains_as_one_gpu(tmp_path, case):
    CASES[case](tmp_path, "cuda")


@needs_gpus(3)
def test_fully_async_on_data_parallel_attention_on_three_gpus_trains_as_one_gpu(tmp_path):
    fully_async_data_parallel(tmp_path, "cuda")


@needs_gpus(4)
def test_tp_x_ep_over_two_groups_on_four_gpus_trains_as_one_gpu(tmp_path):
    tp_ep_over_groups(tmp_path, "cuda")
