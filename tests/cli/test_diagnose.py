"""lathe.cli.diagnose: facts from a probe, checks against lathe's requirements and what multi-GPU runs need from the
environment. The real probe runs on this machine; faked probes stand for GPU hosts (CUDA, ROCm) and broken
setups."""

from __future__ import annotations

import io
import json

import pytest

from lathe.cli import main
from lathe.cli.diagnose import Probe, check, collect, run


class FakeProbe(Probe):
    """A GPU host as told: overrides of every answer the checks read."""

    def __init__(self, **over):
        self.over = {"requirements": ["torch>=2.9", "transformers>=5.0"], "requires_python": ">=3.11",
                     "versions": {"torch": "2.11.0+cu130", "transformers": "5.17.0", "ray": "2.60.0",
                                  "triton": "3.6.0"},
                     "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "hip": None, "cuda_available": True,
                               "cudnn": 91000, "nccl": "2.27.7",
                               "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.2,
                                         "capability": "9.0"} for i in range(2)]},
                     "gpus_present": 2, "driver": "580.95.05", "interfaces": ["eth0", "ib0", "lo"],
                     "infiniband": [], "shm_bytes": 64 * 2**30, "open_files": 1 << 20, "env": {},
                     "cpu": {"cores": 16, "load1": 0.5}, **over}

    def python(self):
        return {"version": "3.12.3", "executable": "/usr/bin/python3"}

    def system(self):
        return {"os": "Linux", "machine": "x86_64", "cpus": 16, "cpu_model": "fake", "memory_gb": 128.0,
                "memory_available_gb": 120.0}

    def requirements(self):
        return self.over["requirements"]

    def requires_python(self):
        return self.over["requires_python"]

    def version(self, name):
        return self.over["versions"].get(name)

    def torch(self):
        return self.over["torch"]

    def gpus_present(self):
        return self.over["gpus_present"]

    def driver(self):
        return self.over["driver"]

    def interfaces(self):
        return self.over["interfaces"]

    def infiniband(self):
        return self.over["infiniband"]

    def shm_bytes(self):
        return self.over["shm_bytes"]

    def open_files(self):
        return self.over["open_files"]

    def env(self):
        return self.over["env"]

    def cpu(self):
        return self.over["cpu"]

    def ray(self, connect):
        return self.over.get("ray", {"address": None, "local_cluster": False})


def verdicts(probe) -> dict[str, tuple[str, str, str]]:
    """name -> (status, detail, fix) of the checks (the last one of a name)."""
    return {c.name: (c.status, c.detail, c.fix) for c in check(collect(probe))}


def failed(probe) -> list[str]:
    return [c.name for c in check(collect(probe)) if c.status == "fail"]


def test_a_good_gpu_host_passes_and_the_report_names_its_gpus():
    out = io.StringIO()
    assert run(probe=FakeProbe(), out=out) == 0
    text = out.getvalue()
    assert "NVIDIA H100 80GB HBM3 79 GiB sm9.0" in text and "NCCL/RCCL 2.27.7" in text and "driver 580.95.05" in text
    assert "0 problem(s), 0 warning(s)" in text


def test_this_machine_reports_without_failing_and_json_is_machine_readable(capsys):
    assert main(["diagnose", "--json"]) == 0, "the CI machine itself must pass lathe's own checks"
    data = json.loads(capsys.readouterr().out)
    assert {"python", "system", "packages", "torch", "env", "ray"} <= set(data["facts"])
    assert data["facts"]["packages"]["torch"] and {c["status"] for c in data["checks"]} <= {"ok", "warn"}
    assert any(c["name"] == "torch" and c["status"] == "ok" for c in data["checks"])


@pytest.mark.parametrize("over,name,words", [
    (dict(versions={"torch": "2.4.1", "transformers": "5.17.0", "ray": "2.60.0", "triton": "3.6.0"}),
     "torch", "outside lathe's range >=2.9"),
    (dict(versions={"torch": "2.11.0", "ray": "2.60.0", "triton": "3.6.0"}), "transformers", "not installed"),
    (dict(requires_python=">=3.13"), "python", "lathe needs >=3.13"),
    (dict(torch={"version": "2.11.0+cu130", "cuda": "13.0", "hip": None, "cuda_available": False, "cudnn": None,
                 "nccl": None, "gpus": []}), "accelerator", "sees no GPU while the driver shows 2"),
    (dict(env={"CUDA_VISIBLE_DEVICES": "0,3"}), "CUDA_VISIBLE_DEVICES", "names 3, but the machine has GPUs 0-1"),
    (dict(env={"CUDA_VISIBLE_DEVICES": "1,1"}), "CUDA_VISIBLE_DEVICES", "lists a GPU twice"),
    (dict(env={"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"}), "HIP_VISIBLE_DEVICES", "differ"),
    (dict(env={"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}), "ROCR_VISIBLE_DEVICES",
     "renumbers the devices"),
    (dict(env={"NCCL_SOCKET_IFNAME": "ens5"}), "NCCL_SOCKET_IFNAME", "no interface ens5 on this machine"),
    (dict(env={"GLOO_SOCKET_IFNAME": "=eth"}), "GLOO_SOCKET_IFNAME", "no interface =eth"),
])
def test_each_broken_setup_fails_naming_what_to_change(over, name, words):
    status, detail, fix = verdicts(FakeProbe(**over))[name]
    assert status == "fail" and words in detail and fix, (status, detail, fix)
    assert run(probe=FakeProbe(**over), out=io.StringIO()) == 1


@pytest.mark.parametrize("over,name,words", [
    (dict(shm_bytes=64 * 2**20), "/dev/shm", "64 MiB"),
    (dict(open_files=1024), "open files", "ulimit -n is 1024"),
    (dict(env={"NCCL_IB_HCA": "mlx5_0"}), "NCCL_IB_HCA", "no InfiniBand device"),
    (dict(env={"NCCL_IB_DISABLE": "1"}, infiniband=["mlx5_0"]), "NCCL_IB_DISABLE", "over sockets"),
    (dict(versions={"torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"}), "ray", "not installed"),
    (dict(versions={"torch": "2.11.0", "transformers": "5.17.0", "ray": "2.60.0"}), "triton", "falls back"),
    (dict(torch={"version": "2.11.0", "cuda": "12.4", "hip": None, "cuda_available": True, "cudnn": 1, "nccl": "2",
                 "gpus": [{"index": 0, "name": "Tesla V100", "memory_gb": 32.0, "capability": "7.0"}]}),
     "bf16", "no bf16"),
    (dict(torch={"version": "2.11.0+cpu", "cuda": None, "hip": None, "cuda_available": False, "cudnn": None,
                 "nccl": None, "gpus": []}), "torch build", "CPU build, but the driver shows 2 GPU(s)"),
    (dict(ray={"address": "10.0.0.1:6379", "local_cluster": False, "error": "ConnectionError: no cluster"}),
     "ray cluster", "could not join Ray at 10.0.0.1:6379"),
    (dict(versions={"torch": "2.11.0", "transformers": "5.17.0", "ray": "2.60.0", "triton": "3.6.0",
                    "flash-linear-attention": "0.6.0"}), "fla backward",
     "refuses its gated delta-rule and Mamba2-scan backwards"),
    (dict(env={"OMP_WAIT_POLICY": "active"}), "cpu threads", "idle OpenMP threads spin"),
    (dict(cpu={"cores": 2, "load1": 1.7}), "cpu threads", "busy (load 1.7 on 2 cores)"),
])
def test_risky_setups_warn_with_a_fix(over, name, words):
    status, detail, fix = verdicts(FakeProbe(**over))[name]
    assert status == "warn" and words in detail and fix, (status, detail, fix)
    assert run(probe=FakeProbe(**over), out=io.StringIO()) == 0


def test_a_rocm_host_with_matching_variables_passes():
    rocm = FakeProbe(torch={"version": "2.9.0+rocm6.4", "cuda": None, "hip": "6.4.43482", "cuda_available": True,
                            "cudnn": None, "nccl": "2.22.3",
                            "gpus": [{"index": 0, "name": "AMD Instinct MI300X", "memory_gb": 191.5,
                                      "capability": "9.4"}]},
                     env={"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "eth"},
                     versions={"torch": "2.9.0", "transformers": "5.17.0", "ray": "2.60.0"})
    v = verdicts(rocm)
    assert v["accelerator"][0] == "ok" and "ROCm/HIP 6.4.43482" in v["accelerator"][1]
    assert v["visible devices"][0] == "ok" and v["NCCL_SOCKET_IFNAME"][0] == "ok" and "triton" not in v
    assert not failed(rocm)


def test_a_cpu_machine_with_cuda_visible_devices_set_is_fine():
    cpu = FakeProbe(torch={"version": "2.13.0+cpu", "cuda": None, "hip": None, "cuda_available": False,
                           "cudnn": None, "nccl": None, "gpus": []}, gpus_present=0,
                    env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert not failed(cpu) and verdicts(cpu)["torch build"][0] == "ok"


def test_packages_lathe_does_not_need_are_not_reported_missing():
    out = io.StringIO()
    run(probe=FakeProbe(), out=out)                        # no wandb, mlflow, hypothesis, peft, vllm, sglang, flash-attn
    text = out.getvalue()
    assert "missing" not in text and "vllm" not in text and "flash-attn" not in text
    assert "optional   not installed, lathe runs without them: wandb (trainer.logger=wandb)" in text
    out = io.StringIO()
    run(probe=FakeProbe(versions={"torch": "2.11.0+cu130", "vllm": "0.11.0"}), out=out)
    text = out.getvalue()
    assert "missing    transformers (required)" in text
    assert "unused     vllm 0.11.0 (other frameworks': lathe does not need them)" in text
