"""Ray worker groups on CPU workers over gloo: the same run as one process, exact resume on any number of
workers, and a killed worker restarted from the last checkpoint or named. (Placement over two simulated nodes and
the worker group's own failures: test_worker_group.py.)"""

from __future__ import annotations

import json
import shutil
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from helpers import assert_close_rel, kill_after_checkpoint, warm_started  # noqa: E402
from lathe.cli import main  # noqa: E402
from lathe.cluster.worker_group import WorkerGroupError  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = ["trainer.total_training_steps=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.logger=[console]"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "response_length/mean")


def train(run_dir, *overrides: str, shared_warm_start: bool = True) -> list[dict]:
    """The built-in run for STEPS, with `overrides`; its warm start shared (tests/helpers.py), or its own."""
    shared = warm_started() if shared_warm_start else ()
    assert main(["train", f"trainer.default_local_dir={run_dir}", *STEPS, *shared, *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same(a: dict, b: dict, keys=COMPARED) -> None:
    """The metrics `keys` of two runs' step, as one vector within 1e-5 norm-relative (a per-key bound failed on 2
    torch threads: summation order)."""
    assert_close_rel([b[k] for k in keys], [a[k] for k in keys], rel=1e-5, name=f"step {a.get('step')} metrics")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The built-in run for 4 steps on one process and on 2 Ray workers (both save at steps 2 and 4; the Ray run
    profiles step 3)."""
    root = tmp_path_factory.mktemp("runs")
    one = train(root / "one", "trainer.save_freq=2")
    two = train(root / "two", "trainer.n_gpus_per_node=2", "trainer.save_freq=2", "global_profiler.tool=torch",
                "global_profiler.steps=[3]", f"global_profiler.save_path={root / 'profile'}")
    return root, one, two


def test_two_workers_train_exactly_as_one_process(runs):
    _, one, two = runs
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert_same(a, b)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_workers_run_colocate_async_without_warmup_exactly_as_one_synchronous_process(runs, tmp_path, tp):
    """verl V1's colocate_async (`lathe.loop.colocate_async`) with no warm-up batch on 2 Ray workers: each rank's
    engine a replica streaming its share of the prompts, or one tensor-parallel replica over both whose ranks take the
    same requests for the same engine steps (`ActorRolloutRefGroup.stream_run_each`): the one process's synchronous
    run (the same samples, seeded by each prompt's place in its step, and the same updates)."""
    _, one, _ = runs
    two = train(tmp_path / "two", "trainer.n_gpus_per_node=2", "trainer.v1.trainer_mode=colocate_async",
                "trainer.v1.colocate_async.num_warmup_batches=0",
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}")
    assert len(two) == 4
    for a, b in zip(one, two):
        assert_same(a, b)
        assert b["training/off_policy/trajectory_staleness_worst/max"] == 0


def test_a_tensor_parallel_replica_continues_interrupted_samples_across_steps(tmp_path, monkeypatch):
    """colocate_async with its warm-up batch on one TP=2 replica over 2 Ray workers, in slices of 2 engine steps:
    samples interrupted at a step's end continue under the next version on both ranks, validation runs beside
    them, and each prompt trains once (all its samples)."""
    import lathe.loop.colocate_async
    monkeypatch.setattr(lathe.loop.colocate_async, "SLICE_STEPS", 2)
    dumps = tmp_path / "dumps"
    rows = train(tmp_path / "run", "trainer.n_gpus_per_node=2",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.v1.trainer_mode=colocate_async", "data.max_response_length=12", "trainer.test_freq=2",
                 f"trainer.rollout_data_dir={dumps}")
    assert sum(r["colocate_async/interrupted"] for r in rows) > 0
    # continued under a later version; how many steps a sample spans (2 in CI's runs, 3 on other machines, where a
    # sample was interrupted twice) follows the sampled lengths, which follow the CPU's float rounding (on one machine
    # the run repeats exactly: interrupted counts, spans, losses), bounded by max_off_policy_threshold (8)
    assert 2 <= max(r["training/off_policy/trajectory_spans/max"] for r in rows) <= 8
    assert any(k.startswith("val-core/") for k in rows[3])
    uids = [json.loads(line)["uid"] for step in range(1, 5)
            for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert len(uids) == 4 * 32 * 8 and all(uids.count(u) == 8 for u in set(uids))


def test_a_profiled_step_covers_every_rank(runs):
    """global_profiler on a Ray run: the driver's phases and each rank's, the worker calls as its phases."""
    root, _, _ = runs
    step = root / "profile" / "step_3"
    summary = json.loads((step / "summary.json").read_text())
    assert "gen" in summary["phases"] and "update_actor" in summary["phases"]      # the driver's timed phases
    assert sorted(summary["ranks"]) == ["actor_rollout_ref_rank0", "actor_rollout_ref_rank1"]
    for name, rank in summary["ranks"].items():
        assert (step / name / "trace.json.gz").stat().st_size > 0
        assert json.loads((step / name / "summary.json").read_text())["rank"] == rank["rank"]
        assert {"actor_rollout_ref.generate_sequences", "actor_rollout_ref.update_actor"} <= set(rank["phases"])
        assert rank["phases"]["actor_rollout_ref.update_actor"]["top_host_ops"]


DISTILLATION = ["distillation.enabled=true", "distillation.distillation_loss.loss_mode=k3",
                "distillation.distillation_loss.distillation_loss_coef=0.5"]
# the losses and the extremes; not the means of micro-batch means (abs_loss), which follow the micro-batch cut
DISTILLED = ("distillation/loss", "distillation/loss_min", "distillation/loss_max")


def distillation_teacher(path):
    """A teacher for on-policy distillation: the built-in tiny model's shape with other weights, the same tokenizer."""
    import torch

    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.hf import build_builtin_model
    tok = builtin_tokenizer()
    model = build_builtin_model("tiny", vocab_size=len(tok), seed=7)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_two_workers_skip_the_old_forward_on_policy_exactly_as_one_process(tmp_path):
    """One mini-batch per step: each rank takes pi_old from its update's forward (how the pieces of the engine-vs-trainer
    diff combine over ranks: tests/algo/test_rollout_correction.py). The responses are scored by a learned reward model
    (`reward_model.enable`, with a chat template of its own), each rank scoring its share with its own copy: the scores
    (`critic/score/*`) are the one process's too (this run carries it: a Ray start costs tens of seconds here). The
    two workers generate as one tensor-parallel engine replica (`rollout.tensor_model_parallel_size=2`): its samples
    and log-probs are the one process's engine's; and they train as one Ulysses sequence-parallel group
    (`ulysses_sequence_parallel_size=2`, the reference's too under the KL loss), each micro-batch holding twice the
    per-device token budget (verl's rule): the same losses and gradient norms as one process. A teacher distils into
    the policy (on-policy distillation, k3 reverse KL), sharded on the trainer's ranks like the reference. Token-level
    TIS is on: the update computes it from its own forward (no old-policy pass either way), with the one process's
    `rollout_corr/*` metrics."""
    from helpers import RM_TEMPLATE, tiny_reward_model
    path = tiny_reward_model(tmp_path / "rm", chat_template=RM_TEMPLATE)
    teacher = distillation_teacher(tmp_path / "teacher")
    rm = ["reward_model.enable=true", f"reward_model.model.path={path}", "reward_model.micro_batch_size_per_gpu=3",
          "reward_model.max_length=256"]
    a_ = "actor_rollout_ref.actor"
    on_policy = [f"{a_}.ppo_mini_batch_size=32", "trainer.total_training_steps=2", *rm, f"{a_}.use_kl_loss=true",
                 f"{a_}.kl_loss_coef=0.1", f"{a_}.use_dynamic_bsz=true", "actor_rollout_ref.model.use_remove_padding=true",
                 *DISTILLATION, f"distillation.teacher_models.teacher_model.model_path={teacher}",
                 "algorithm.rollout_correction.rollout_is=token"]
    one = train(tmp_path / "one", *on_policy, f"{a_}.ppo_max_token_len_per_gpu=4096")
    two = train(tmp_path / "two", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                f"{a_}.ulysses_sequence_parallel_size=2", f"{a_}.ppo_max_token_len_per_gpu=2048", *on_policy)
    assert len(one) == len(two) == 2
    assert one[-1]["actor/kl_loss"] > 0                 # the reference differs from the policy after step 1
    for a, b in zip(one, two):
        assert a["distillation/loss"] > 0.01
        assert_same(a, b, (*DISTILLED, "actor/kl_loss"))
        assert "timing_s/old_log_prob" not in a and "timing_s/old_log_prob" not in b
        assert "reward_extra/acc/mean" not in a and a["critic/score/max"] > a["critic/score/min"]  # the RM's scores
        assert_same(a, b)
        for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std"):
            assert 0 <= a[key] < 1e-4 and 0 <= b[key] < 1e-4, (key, a[key], b[key])    # fp32 rounding on both sides
        for key in ("rollout_corr/training_ppl", "rollout_corr/rollout_ppl", "rollout_corr/rollout_is_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_a_reward_model_and_a_teacher_on_pools_of_their_own_score_and_distil_as_the_colocated_ones(tmp_path, caplog):
    """`reward_model.enable_resource_pool` and `distillation.nnodes` x `n_gpus_per_node`: one trainer worker, the
    reward model on a worker group of its own (one rank) and the teacher on another (one rank, a whole copy), a Ray
    run even with one trainer device; the scores, the distillation loss and the update are the colocated one-process
    run's. The pooled run scores in the background (`launch_reward_fn_async`): the reward model's pass overlaps the
    step's log-prob passes and joins before the advantages. (Both pools in one run, as in test_fully_async.py: one
    Ray run and one one-process twin fewer than a run for each; each pool's own checks are unchanged.)"""
    from helpers import RM_TEMPLATE, tiny_reward_model
    path = tiny_reward_model(tmp_path / "rm", chat_template=RM_TEMPLATE)
    teacher = distillation_teacher(tmp_path / "teacher")
    both = ["reward_model.enable=true", f"reward_model.model.path={path}", "reward_model.micro_batch_size_per_gpu=3",
            "reward_model.max_length=256", *DISTILLATION,
            f"distillation.teacher_models.teacher_model.model_path={teacher}", "trainer.total_training_steps=2"]
    one = train(tmp_path / "one", *both)
    with caplog.at_level("INFO", logger="lathe"):
        pooled = train(tmp_path / "pooled", *both, "reward_model.enable_resource_pool=true", "reward_model.nnodes=1",
                       "reward_model.n_gpus_per_node=1", "reward_model.launch_reward_fn_async=true",
                       "distillation.nnodes=1", "distillation.n_gpus_per_node=1",
                       "ray_kwargs.ray_init.num_cpus=4")      # (three one-slot workers: the shared cluster's CPUs)
    started = [r.getMessage() for r in caplog.records if " workers over " in r.getMessage()]
    assert [m.split(":")[0] for m in started] == ["actor_rollout_ref", "reward_model", "teacher"], started  # 1 each
    assert len(one) == len(pooled) == 2
    keys = ("critic/score/mean", "critic/score/max", "critic/score/min", "actor/pg_loss", "actor/grad_norm")
    for a, b in zip(one, pooled):
        assert a["critic/score/max"] > a["critic/score/min"]            # the reward model's scores
        assert a["distillation/loss"] > 0.01
        assert_same(a, b, keys)
        assert_same(a, b, (*DISTILLED, "actor/pg_loss", "actor/grad_norm"))
        assert "timing_s/reward_wait" in b and "timing_s/reward_wait" not in a     # joined from the background


def test_a_teacher_pool_that_cannot_be_placed_names_the_distillation_keys():
    """The teachers' group is named 'teacher', its sizes are distillation.*: a placement that times out says so."""
    from lathe.cluster import teacher_pool
    from lathe.cluster.placement import ClusterError
    from lathe.config import load_config, run_plan
    cfg = load_config(None, ["trainer.device=cpu", "distillation.enabled=true", "distillation.nnodes=1",
                             "distillation.n_gpus_per_node=64",
                             "distillation.teacher_models.teacher_model.model_path=builtin:tiny"])
    with pytest.raises(ClusterError, match=r"distillation.nnodes=1 x distillation.n_gpus_per_node=64: could not place "
                                           r".*Fix: lower distillation.n_gpus_per_node / nnodes"):
        teacher_pool(cfg, run_plan(cfg), None, "cpu", timeout_s=1)


@pytest.mark.parametrize("rollout_pool", [(), ("rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                                 "data.train_batch_size=0", "ray_kwargs.ray_init.num_cpus=4")],
                         ids=["sync", "fully_async"])
def test_a_reward_pool_that_fails_to_start_releases_the_trainers_workers(tmp_path, monkeypatch, rollout_pool):
    """The reward model's group fails as it builds (the synchronous loop: after the trainer's group is up; fully
    async: while the trainer's and the rollout's start beside it): the error goes on, and every CPU slot of the
    (shared) Ray cluster is free again."""
    import lathe.cluster
    from helpers import tiny_reward_model
    path = tiny_reward_model(tmp_path / "rm")

    def broken(*args, **kwargs):
        raise RuntimeError("reward pool could not start")
    monkeypatch.setattr(lathe.cluster, "reward_pool", broken)
    with pytest.raises(RuntimeError, match="reward pool could not start"):
        train(tmp_path / "run", "reward_model.enable=true", f"reward_model.model.path={path}",
              "reward_model.enable_resource_pool=true", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1",
              *rollout_pool)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        assert time.monotonic() < deadline, "the trainer's workers were left running"
        time.sleep(0.2)


def test_two_workers_train_prefix_grouped_exactly_as_one_process(tmp_path):
    """`actor.use_prefix_grouper` over 2 ranks: with `trainer.balance_batch` each prompt's rows are dealt whole to one
    rank (verl's group balancing), and each rank's old-log-prob, reference (the KL loss) and update passes run
    grouped, token-budget micro-batches keeping prompts whole: the same losses and gradient norms as one process
    grouped (whose numbers are the per-row run's: tests/loop/test_algorithms.py)."""
    a_ = "actor_rollout_ref.actor"
    grouped = [f"{a_}.use_prefix_grouper=true", "trainer.balance_batch=true", f"{a_}.use_kl_loss=true",
               f"{a_}.kl_loss_coef=0.1", f"{a_}.ppo_epochs=2", f"{a_}.use_dynamic_bsz=true",
               f"{a_}.ppo_max_token_len_per_gpu=2048", "actor_rollout_ref.model.use_remove_padding=true",
               "trainer.total_training_steps=2"]
    one = train(tmp_path / "one", *grouped)
    two = train(tmp_path / "two", "trainer.n_gpus_per_node=2", *grouped)
    assert len(one) == len(two) == 2 and one[-1]["actor/kl_loss"] > 0 and "timing_s/old_log_prob" in one[-1]
    for a, b in zip(one, two):
        assert_same(a, b, (*COMPARED, "actor/kl_loss"))


def test_one_ray_worker_runs_the_sharded_path_exactly_as_one_process(runs, tmp_path, monkeypatch):
    """LATHE_RAY=1: one device as a worker group of one FSDP2 rank (how the distributed path is checked on one GPU)."""
    monkeypatch.setenv("LATHE_RAY", "1")
    _, one, _ = runs
    for a, b in zip(one, train(tmp_path / "ray1")):
        assert_same(a, b)


@pytest.mark.parametrize("saved_by,workers", [("two", 2), ("two", 1), ("one", 2)])
def test_resume_is_exact_on_any_worker_count(runs, tmp_path, saved_by, workers):
    """Ranks write their shards (torch.distributed.checkpoint), which load on any number of ranks or in one
    process; a one-process checkpoint (full state) loads on several ranks."""
    root, one, two = runs
    if saved_by == "two":
        assert len(list((root / "two" / "global_step_2" / "actor" / "sharded").glob("*.distcp"))) == 2
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copytree(root / saved_by / "global_step_2", run / "global_step_2")     # (the warm start is shared)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one[:2]))
    resumed = train(run, f"trainer.n_gpus_per_node={workers}")
    assert_same(resumed[-1], two[-1])


def test_export_gives_transformers_the_same_model_from_full_and_sharded_checkpoints(runs, tmp_path):
    """verl's model_merger: the one-process run's checkpoint and the 2-rank sharded one export to Hugging Face
    directories that transformers loads, with the same weights up to the runs' float summation order."""
    from transformers import AutoModelForCausalLM

    from helpers import assert_close_rel
    from lathe.ckpt.export import check_loads, export
    root, _, _ = runs
    full, sharded = export(root / "one", tmp_path / "one"), export(root / "two", tmp_path / "two")
    for out in (full, sharded):
        assert check_loads(out)["logits_finite"]
    weights = [AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (full, sharded)]
    assert_close_rel(weights[1], weights[0], rel=1e-5, name="step-4 weights")


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_killed_worker_restarts_from_the_last_checkpoint_or_stops_naming_it(runs, tmp_path, restarts):
    """SIGKILL rank 1 right after the step-2 checkpoint: with restarts allowed the run reloads step 2 on fresh
    workers and ends exactly as the uninterrupted run; without, it stops naming the rank."""
    from lathe.config import load_config
    from lathe.loop.ppo import fit
    from lathe.loop.setup import build_trainer
    _, _, two = runs
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"trainer.default_local_dir={run_dir}", *STEPS, *warm_started(),
                             "trainer.n_gpus_per_node=2",
                             "trainer.save_freq=2", f"trainer.restart_on_worker_failure={restarts}"])
    t = build_trainer(cfg)
    pid = t.cluster.group.nodes[1]["pid"]
    kill_after_checkpoint(run_dir, pid, step=2)
    try:
        if restarts:
            fit(t)
        else:
            with pytest.raises(WorkerGroupError, match="rank 1 on .* died during"):
                fit(t)
            return
    finally:
        t.close()
    assert t.cluster.group.nodes[1]["pid"] != pid                       # a new rank 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]                    # each step once in the log
    assert_same(rows[-1], two[-1])
