"""`global_profiler.tool=torch`: a trace and a per-phase summary of the listed steps, and the config's refusals."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from lathe.config import ConfigError, load_config
from lathe.track import Timer
from lathe.track.profile import CLASSES, NO_PHASE, StepProfiler, device_phases, kernel_class, kernel_kind


def fake_step(timer: Timer) -> None:
    a = torch.randn(64, 64)
    with timer("gen"):
        for _ in range(3):
            a = a @ a / 64
    with timer("update_actor"):
        (a.relu() + 1).sum()
    with timer("gen"):                  # a second generation round (DAPO): its seconds add to the phase
        torch.mm(a, a)


def test_a_listed_step_writes_a_trace_and_a_summary_by_phase(tmp_path):
    profiler = StepProfiler("torch", [2], tmp_path / "prof", torch.device("cpu"))
    timer = Timer()
    for step in (1, 2, 3):
        with profiler.step(step):
            fake_step(timer)
    assert [p.name for p in profiler.written] == ["step_2"]
    out = tmp_path / "prof" / "step_2"
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["step_2"]
    trace = json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"timing/gen", "timing/update_actor"} <= names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2 and summary["wall_s"] > 0
    phases = summary["phases"]
    assert set(phases) == {"gen", "update_actor"}
    assert 0 < phases["gen"]["wall_s"] < summary["wall_s"]
    gen_ops = {op["name"]: op["calls"] for op in phases["gen"]["top_host_ops"]}
    assert gen_ops.get("aten::mm") == 4, gen_ops            # 3 in the first round, 1 in the second
    assert "aten::relu" in {op["name"] for op in phases["update_actor"]["top_host_ops"]}


def test_with_stack_records_python_frames(tmp_path):
    profiler = StepProfiler("torch", [1], tmp_path, torch.device("cpu"), with_stack=True)
    with profiler.step(1):
        fake_step(Timer())
    trace = json.loads(gzip.decompress((tmp_path / "step_1" / "trace.json.gz").read_bytes()))
    frames = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "python_function"}
    assert any("fake_step" in name for name in frames), sorted(frames)[:20]


def test_the_timer_opens_a_range_only_while_the_profiler_records(monkeypatch):
    """Unprofiled phases pay nothing: no record_function is created (the phase timer runs many times a step)."""
    from torch.autograd import profiler
    from lathe.track import timer as timer_module
    made = []
    real = profiler.record_function
    monkeypatch.setattr(profiler, "record_function", lambda name: made.append(name) or real(name))
    timer = Timer()
    with timer("gen"):
        pass
    assert made == [] and timer.seconds["gen"] >= 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with timer("update_actor"):
            pass
    assert made == ["timing/update_actor"]
    assert timer_module._profiler_range("gen") is None


def test_a_worker_rank_profiles_the_calls_made_meanwhile(tmp_path):
    """A Ray rank (`RankHost`, called here in this process) between profile_start and profile_stop: each call the
    driver makes is a phase of its summary, written under `<step dir>/<group>_rank<R>/`."""
    from lathe.cluster.worker_group import RankHost

    class Role:
        def work(self, n):
            return (torch.randn(n, n) @ torch.randn(n, n)).sum().item()

    host = RankHost(1, 2, 1, group_name="actor_rollout_ref")
    host.build("actor_rollout_ref", Role, (), {})
    host.profile_start(False)
    host.call("actor_rollout_ref", "work", (32,), {})
    summary = host.profile_stop(str(tmp_path))
    assert host.profiler is None and host.call("actor_rollout_ref", "work", (4,), {}) is not None
    assert summary["rank"] == 1 and summary["phases"]["actor_rollout_ref.work"]["top_host_ops"]
    written = tmp_path / "actor_rollout_ref_rank1"
    assert json.loads((written / "summary.json").read_text()) == summary and (written / "trace.json.gz").exists()


def test_the_driver_starts_and_stops_every_rank_for_the_listed_steps(tmp_path):
    calls = []

    class Group:                  # RayWorkerGroup's face: a RankHost method on every rank, answers in rank order
        name = "actor_rollout_ref"

        def host_call(self, method, *args):
            calls.append((method, args))
            return [None, None] if method == "profile_start" else [{"rank": 0}, {"rank": 1}]

    profiler = StepProfiler("torch", [2], tmp_path, torch.device("cpu"), workers=[Group()])
    timer = Timer()
    for step in (1, 2):
        with profiler.step(step):
            fake_step(timer)
    assert calls == [("profile_start", (False,)), ("profile_stop", (str(tmp_path / "step_2"),))]
    summary = json.loads((tmp_path / "step_2" / "summary.json").read_text())
    assert summary["ranks"] == {"actor_rollout_ref_rank0": {"rank": 0}, "actor_rollout_ref_rank1": {"rank": 1}}
    assert "gen" in summary["phases"]


def test_device_kernels_count_for_the_phase_that_launched_them():
    """Kernels run after their launch; a backward launches from another thread; a graph replay is one launch of many
    kernels; phases nest (the innermost wins)."""
    def launch(tid, ts, corr, name="cudaLaunchKernel", cat="cuda_runtime"):
        return {"cat": cat, "name": name, "ph": "X", "tid": tid, "ts": ts, "dur": 5, "args": {"correlation": corr}}

    def kernel(ts, dur, corr, name):
        return {"cat": "kernel", "name": name, "ph": "X", "tid": 7, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "timing/gen", "ph": "X", "tid": 1, "ts": 0, "dur": 1000},
        {"cat": "user_annotation", "name": "timing/gen_max", "ph": "X", "tid": 1, "ts": 800, "dur": 100},
        {"cat": "user_annotation", "name": "timing/update_actor", "ph": "X", "tid": 1, "ts": 2000, "dur": 1000},
        launch(1, 10, 1, "cudaGraphLaunch"),
        kernel(20, 100, 1, "_decode_kernel"), kernel(130, 50, 1, "nvjet_sm90_tst_64x32"),
        launch(1, 990, 2, "cuLaunchKernel", "cuda_driver"), kernel(2100, 300, 2, "triton_poi_fused_mul_silu"),
        launch(1, 850, 3), kernel(860, 10, 3, "gemm_small"),
        launch(2, 2500, 4), kernel(2600, 200, 4, "flash_bwd_kernel"),          # autograd's thread
        launch(1, 1500, 5), kernel(1510, 40, 5, "memset"),                       # between the phases
        {"cat": "cpu_op", "name": "aten::mm", "ph": "X", "tid": 1, "ts": 2010, "dur": 100},
        {"cat": "cpu_op", "name": "aten::item", "ph": "X", "tid": 1, "ts": 2200, "dur": 300},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ph": "X", "tid": 1, "ts": 2210, "dur": 250},
    ]}
    phases = device_phases(trace)
    gen = phases["gen"]
    assert gen["wall_s"] == pytest.approx(1e-3) and gen["device_s"] == pytest.approx(450e-6)
    assert gen["kinds"] == pytest.approx({"attention": 100e-6, "matmul": 50e-6, "other": 300e-6})
    assert sum(gen["classes"].values()) == pytest.approx(gen["device_s"])
    assert gen["classes"]["fused_elementwise"] == pytest.approx(300e-6)
    assert gen["top"][0] == {"name": "triton_poi_fused_mul_silu", "s": pytest.approx(300e-6), "calls": 1}
    assert phases["gen_max"]["device_s"] == pytest.approx(10e-6)
    assert phases["update_actor"]["kinds"]["attention"] == pytest.approx(200e-6)
    assert phases["update_actor"]["device_busy_fraction"] == pytest.approx(0.2)
    assert phases[NO_PHASE]["device_s"] == pytest.approx(40e-6) and phases[NO_PHASE]["wall_s"] is None
    host = {row["name"]: row["self_s"] for row in phases["update_actor"]["host_top"]}     # own time, children out
    assert host == pytest.approx({"cudaStreamSynchronize": 250e-6, "aten::mm": 100e-6, "aten::item": 50e-6,
                                  "cudaLaunchKernel": 5e-6})


def test_kernel_kinds():
    assert kernel_kind("nvjet_sm90_tst_64x32_64x16_2x4_h_badd_TNT") == "matmul"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kernel_kind("flash_fwd_kernel<...>") == "attention"
    assert kernel_kind("_decode_kernel") == "attention"
    assert kernel_kind("triton_poi_fused_mul_silu_1") == "other"


@pytest.mark.parametrize("name, cls", [
    ("nvjet_sm90_tst_128x192_64x5_1x2_h_bz_coopB_NNN", "matmul"),
    ("flash_fwd_kernel<...>", "attention_fwd"),
    ("flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention_bwd"),
    ("void cunn_SoftMaxForward<8, float>", "softmax_vocab"),
    ("triton_red_fused__log_softmax_gather_3", "softmax_vocab"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused_elementwise"),
    ("triton_poi_fused_mul_silu_silu_backward_0", "fused_elementwise"),
    ("triton_red_fused__to_copy_add_amax_div_exp_gather_log_mul_squeeze_sub_sum_unsqueeze_0", "softmax_vocab"),
    ("triton_poi_fused__to_copy_arange_div_eq_exp_mul_scalar_tensor_sub_unsqueeze_where_0", "softmax_vocab"),
    ("void at::native::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
    ("void at::native::reduce_kernel<512, 1, ...>", "reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
    # eager kernels name a lambda: not LAMB, not the optimizer (this once put 0.09 s of a 1.5B update's casts and
    # reductions under "optimizer", where AdamW itself took 0.013)
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, ...>", "copy"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<"
     "c10::BFloat16, at::native::sum_functor<...>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, ...>",
     "reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::sin_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#2}::operator()() const::{lambda(float)#1}, ...>", "elementwise"),
    ("some_unknown_kernel", "other")])
def test_kernel_classes(name, cls):
    assert kernel_class(name) == cls and cls in CLASSES


@pytest.mark.parametrize("overrides, message", [
    (["global_profiler.tool=nsys", "global_profiler.steps=[1]"], "Nsight Systems is not implemented"),
    (["global_profiler.tool=torch"], "lists no step"),
    (["global_profiler.steps=[1,2]"], "global_profiler.tool is not set"),
    (["global_profiler.with_stack=true"], "with_stack=True but global_profiler.tool is not set"),
    (["global_profiler.tool=torch", "global_profiler.steps=[0]"], "not step numbers"),
    (["global_profiler.tool=torch", "global_profiler.steps=[1]", "global_profiler.profile_continuous_steps=true"],
     "one trace across consecutive profiled steps"),
    (["global_profiler.tool=torch", "global_profiler.steps=[1]", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"],
     "fully asynchronous"),
])
def test_profiler_settings_lathe_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("base", overrides)


def test_ray_runs_may_be_profiled(monkeypatch):
    load_config("base", ["global_profiler.tool=torch", "global_profiler.steps=[1]", "trainer.n_gpus_per_node=2"])
    monkeypatch.setenv("LATHE_RAY", "1")
    load_config("base", ["global_profiler.tool=torch", "global_profiler.steps=[1]"])


def test_verl_profiler_defaults_load_silently():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("base", ["global_profiler.tool=torch", "global_profiler.steps=[2]",
                                   "global_profiler.save_path=/tmp/p", "global_profiler.profile_continuous_steps=false",
                                   "+global_profiler.global_tool_config.torch_memory.stack_depth=32"])
    assert cfg.global_profiler.steps == [2] and cfg.global_profiler.save_path == "/tmp/p"
