"""`global_profiler.tool=torch_memory`: verl's settings read and checked, the CPU refused, and each listed step's
snapshot written per rank (torch's allocator-history functions faked here; tests/loop/test_ppo.py runs it on a GPU)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from config.verl_corpus import problems
from lathe import device as accel
from lathe.config import ConfigError, load_config
from lathe.config.profiler import MemoryHistorySettings, torch_memory_settings
from lathe.track.profile import StepProfiler

MEMORY = "global_profiler.global_tool_config.torch_memory"
GPU = ["trainer.device=auto"]          # auto: loads on this CPU machine too


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.memory's history functions, recorded instead of run; the calls in order."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))

    def dump(path):
        calls.append(("dump", path))
        with open(path, "wb") as f:
            f.write(b"snapshot")
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(accel, "synchronize", lambda device: calls.append(("sync", str(device))))
    return calls


def test_verl_profile_script_loads():
    assert problems("profile_run_qwen2_5_vl_7b_torch_memory") == []


def test_verl_settings_are_read_with_verl_defaults():
    cfg = load_config("base", [*GPU, "global_profiler.tool=torch_memory", "global_profiler.steps=[3]",
                               f"+{MEMORY}.trace_alloc_max_entries=500", f"+{MEMORY}.stacks=python",
                               f"+{MEMORY}.kw_args.clear_history=true", f"+{MEMORY}.stack_depth=32"])
    assert torch_memory_settings(cfg.global_profiler.global_tool_config) == MemoryHistorySettings(
        max_entries=500, context="all", stacks="python", kw_args={"clear_history": True})
    assert torch_memory_settings({}) == MemoryHistorySettings(max_entries=100_000, context="all", stacks="all")


@pytest.mark.parametrize("overrides, message", [
    (["trainer.device=cpu"], "trainer.device=cpu has no such allocator"),
    ([f"+{MEMORY}.trace_alloc_max_entries=0"], "trace_alloc_max_entries=0: expected a whole number >= 1"),
    ([f"+{MEMORY}.stack_depth=-1"], "stack_depth=-1: expected a whole number"),
    ([f"+{MEMORY}.context=everything"], "context='everything' is not one torch takes"),
    ([f"+{MEMORY}.stacks=cpp"], "stacks='cpp' is not one torch takes"),
    ([f"+{MEMORY}.kw_args.device=0"], "kw_args.device: torch's _record_memory_history takes no such keyword"),
    ([f"+{MEMORY}.depth=3"], "depth=3 is not a torch_memory setting"),
    (["global_profiler.with_stack=true"], "with_stack=True is a setting of global_profiler.tool=torch"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1"], "tool=torch_memory profiles the steps of the synchronous"),
])
def test_settings_lathe_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("base", [*GPU, "global_profiler.tool=torch_memory", *overrides])


def test_under_gradient_checkpointing_context_all_records_as_alloc_and_says_so():
    """torch 2.11 failed in a checkpointed backward on an H200 while frees' stacks were recorded (context=all)."""
    on = [*GPU, "global_profiler.tool=torch_memory", "actor_rollout_ref.model.enable_gradient_checkpointing=true"]
    with pytest.warns(UserWarning, match="context=all .* records as context=alloc"):
        cfg = load_config("base", on)
    assert torch_memory_settings(cfg.global_profiler.global_tool_config, checkpointing=True).context == "alloc"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("base", [*on, f"+{MEMORY}.context=state"])               # asked for another: kept, no notice
        load_config("base", [*on, "actor_rollout_ref.model.gradient_checkpointing_layers=0",     # none recomputes
                             "critic.model.gradient_checkpointing_layers=0"])
    assert torch_memory_settings({"torch_memory": {"context": "state"}}, checkpointing=True).context == "state"


def test_a_stack_depth_torch_cannot_take_warns():
    with pytest.warns(UserWarning, match="stack_depth=8 has no effect"):
        load_config("base", [*GPU, "global_profiler.tool=torch_memory", f"+{MEMORY}.stack_depth=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("base", [*GPU, "global_profiler.tool=torch_memory", f"+{MEMORY}.stack_depth=32",
                             "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                             "critic.model.enable_gradient_checkpointing=false"])


def test_a_listed_step_writes_one_snapshot_and_stops_recording(tmp_path, fake_cuda):
    settings = MemoryHistorySettings(max_entries=7, context="alloc", stacks="python", kw_args={"clear_history": True})
    profiler = StepProfiler("torch_memory", [2], tmp_path, torch.device("cuda"), memory=settings)
    for step in (1, 2, 3):
        with profiler.step(step):
            fake_cuda.append(("body", step))
    path = str(tmp_path / "step_2" / "torch_memory_rank0.pickle")
    assert fake_cuda == [("body", 1),
                         ("record", dict(enabled="all", context="alloc", stacks="python", max_entries=7,
                                         device=torch.device("cuda"), clear_history=True)),
                         ("body", 2), ("sync", "cuda"), ("dump", path),
                         ("record", dict(enabled=None, device=torch.device("cuda"))),
                         ("body", 3)]
    assert [p.name for p in profiler.written] == ["step_2"] and (tmp_path / "step_2").is_dir()


def test_no_steps_records_step_one(tmp_path, fake_cuda, caplog):
    with caplog.at_level(logging.WARNING):
        profiler = StepProfiler("torch_memory", None, tmp_path, torch.device("cuda"))
    assert profiler.steps == {1} and "step 1 is recorded" in caplog.text


def test_a_failing_step_stops_recording_and_writes_nothing(tmp_path, fake_cuda):
    profiler = StepProfiler("torch_memory", [1], tmp_path, torch.device("cuda"))
    with pytest.raises(RuntimeError):
        with profiler.step(1):
            raise RuntimeError("the step failed")
    assert [c[0] for c in fake_cuda] == ["record", "record"] and fake_cuda[1][1]["enabled"] is None
    assert not (tmp_path / "step_1").exists()


def test_a_cpu_run_says_so_and_records_nothing(tmp_path, fake_cuda, caplog):
    with caplog.at_level(logging.WARNING):
        profiler = StepProfiler("torch_memory", [1], tmp_path, torch.device("cpu"))
        with profiler.step(1):
            pass
    assert "no memory snapshot is written" in caplog.text and fake_cuda == [] and not profiler.written


def test_every_ray_rank_writes_its_own_snapshot(tmp_path, fake_cuda, monkeypatch):
    """The driver asks every rank of every group (RankHost, called here in this process) to record and dump; the
    driver itself, holding no model, records nothing."""
    from lathe.cluster.worker_group import RankHost
    monkeypatch.setattr(RankHost, "_device", lambda self: torch.device("cuda"))
    hosts = [RankHost(r, 2, 1, group_name="actor_rollout_ref") for r in range(2)]

    class Group:                    # RayWorkerGroup's face: a RankHost method on every rank, answers in rank order
        name = "actor_rollout_ref"

        def host_call(self, method, *args):
            return [getattr(h, method)(*args) for h in hosts]

    profiler = StepProfiler("torch_memory", [1], tmp_path, torch.device("cuda"), workers=[Group()],
                            memory=MemoryHistorySettings(max_entries=9))
    with profiler.step(1):
        pass
    dumps = [c[1] for c in fake_cuda if c[0] == "dump"]
    assert dumps == [str(tmp_path / "step_1" / f"torch_memory_actor_rollout_ref_rank{r}.pickle") for r in (0, 1)]
    assert [c[1]["max_entries"] for c in fake_cuda if c[0] == "record" and c[1]["enabled"]] == [9, 9]
    assert all(h.memory_history is None for h in hosts)
