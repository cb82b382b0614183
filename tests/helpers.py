"""Shared test helpers (imported as `from helpers import ...`: pytest puts `tests/` on the path).

`assert_close_rel` is how the suite compares floating-point results that two code paths compute in different
orders (packed vs padded, chunked vs full, compiled vs eager, micro-batched vs whole, lathe vs transformers).
Such results differ by rounding of about 1e-7 of the tensor's scale, and by how much exactly depends on the
CPU's kernels: an element near zero then fails any element-wise relative test on some machine, and an
element-wise absolute test is only right for one scale. The norm-relative error ‖a − b‖ / ‖b‖ measures the
difference against the whole tensor's scale, so the same tolerance holds on any machine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from lathe import ports


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def _flatten(x: Mapping, keys: list) -> torch.Tensor:
    return torch.cat([_as_float64(x[k]).flatten() for k in keys])


def rel_error(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (‖actual − expected‖ when `expected` is all zeros)."""
    a, b = _as_float64(actual), _as_float64(expected)
    diff, scale = float((a - b).norm()), float(b.norm())
    return diff / scale if scale > 0 else diff


def assert_close_rel(actual, expected, rel: float = 1e-5, name: str = "value") -> float:
    """Assert ‖actual − expected‖ / ‖expected‖ <= rel (Frobenius norms, in float64); return the error.

    `actual` and `expected` are tensors, arrays, nested lists or scalars of the same shape, or two mappings
    with the same keys (e.g. gradients by parameter name), compared as one vector so that a tensor whose true
    value is ~0 (its rounding noise is all there is) does not decide alone. Fails on a shape or key mismatch
    and on NaN or inf on either side; when `expected` is all zeros, `actual` must be within `rel` of zero.
    """
    keys = None
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{name}: expected a mapping, got {type(actual).__name__}"
        keys = list(expected)
        assert set(actual) == set(keys), f"{name}: keys differ: {sorted(set(actual) ^ set(keys))}"
        for k in keys:
            assert tuple(actual[k].shape) == tuple(expected[k].shape), f"{name}[{k!r}]: shapes differ"
        a, b = _flatten(actual, keys), _flatten(expected, keys)
    else:
        a, b = _as_float64(actual), _as_float64(expected)
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    assert torch.isfinite(b).all(), f"{name}: expected holds NaN/inf"
    assert torch.isfinite(a).all(), f"{name}: actual holds NaN/inf where expected is finite"
    err = rel_error(a, b)
    if err > rel:
        raise AssertionError(f"{name}: ‖actual − expected‖ / ‖expected‖ = {err:.3g} > {rel:g} "
                             f"(‖expected‖ = {float(b.norm()):.3g}{_worst(actual, expected, keys, a, b)})")
    return err


def _worst(actual, expected, keys, a: torch.Tensor, b: torch.Tensor) -> str:
    """Where the difference is largest: the element, or for mappings the entry, that a failure should name."""
    if keys is not None:
        norms = {k: float((_as_float64(actual[k]) - _as_float64(expected[k])).norm()) for k in keys}
        k = max(norms, key=norms.get)
        return f"; most of it in {k!r}: ‖difference‖ = {norms[k]:.3g}"
    d = (a - b).abs()
    if d.numel() == 0:
        return ""
    i = int(d.flatten().argmax())
    where = tuple(int(j) for j in np.unravel_index(i, tuple(d.shape)))
    return f"; largest |difference| {float(d.flatten()[i]):.3g} at {where}"


def local_gpus() -> int:
    """CUDA devices this process sees (verl's get_local_gpus_num): multi-GPU tests size themselves by it."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's or a store's rendezvous; `lathe.ports`)."""
    return ports.free_port("127.0.0.1")


class RankCrashed(AssertionError):
    """A rank of `run_processes` failed while another died of a signal: torch's gloo and DTensor code has crashed so
    under load (SIGSEGV, a rank of test_tp_ulysses_lora_mtp in a CI run, a rank of
    test_tensor_parallel_hybrid's FSDP2 test in a local suite, 2026-12-06; neither again when run alone), so the
    launchers run the ranks once more (`again_after_a_crash`)."""


def run_processes(procs: list, queue, timeout_s: float) -> dict:
    """Start `procs`, each of which puts one (rank, result) on `queue` (the text of its traceback when it failed), and
    wait for every one within `timeout_s`: {rank: result}. A failed rank fails the caller with its traceback
    (`RankCrashed` when a process died of a signal); a process still alive at the end is killed, so a broken
    collective never hangs the suite."""
    for p in procs:
        p.start()
    results, failed = {}, True
    try:
        for _ in procs:
            rank, result = queue.get(timeout=timeout_s)
            if isinstance(result, str):
                deaths = _deaths(procs)
                raise (RankCrashed if deaths else AssertionError)(f"rank {rank} failed:\n{result}{deaths}")
            results[rank] = result
        failed = False
    finally:
        for p in procs:        # (after a failure the others may wait on the failed rank: killed after a moment)
            p.join(timeout=5 if failed else timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


def again_after_a_crash(launch):
    """`launch()`, and once more, with a warning, when a rank died of a signal (`RankCrashed`): a crash that comes
    back fails the test."""
    try:
        return launch()
    except RankCrashed as crash:
        warnings.warn(f"a rank died of a signal; the ranks run once more. The first run: {crash}")
        return launch()


def forkserver_ranks(module: str, target, world: int, timeout_s: float) -> dict:
    """`target(rank, port, queue)` (a function of `module`, which a test's ranks import: the forkserver imports torch
    and lathe once) in `world` processes: {rank: result} (`run_processes`, `again_after_a_crash`)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([module])

    def launch():
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=target, args=(r, port, queue), daemon=True) for r in range(world)]
        return run_processes(procs, queue, timeout_s)
    return again_after_a_crash(launch)


def _deaths(procs: list) -> str:
    """The processes that died of a signal (a crash on one rank shows on the others as a lost connection)."""
    import signal
    time.sleep(0.5)                         # (a crashed rank's exit lands just after the others' errors)
    dead = [f"process {i} (pid {p.pid}) died of {signal.Signals(-p.exitcode).name}" for i, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode < 0]
    return "\n" + "; ".join(dead) if dead else ""


def gloo_rank(rank: int, world: int, port: int, queue, work, timeout_s: float = 120) -> None:
    """The body of a `run_processes` rank: join a gloo group of `world` on `port` (one torch thread), run `work()`,
    put (rank, its result, or True when it returns None) on `queue`, or the traceback's text when anything failed;
    leave the group."""
    import datetime
    import traceback

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        torch.set_num_threads(1)
        result = work()
        queue.put((rank, True if result is None else result))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_saving_ranks(rank_main, world: int, root: Path, preload: list[str], timeout_s: float = 120) -> list:
    """Run `rank_main(rank, port, str(root), queue)` (a `gloo_rank` body that saves its results as
    `root/rank<r>.pt`) in `world` processes forked from one forkserver that imports `preload` once (a process start
    costs seconds here), and load each rank's results, in rank order."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)

    def launch():
        queue, port = ctx.Queue(), free_port()
        run_processes([ctx.Process(target=rank_main, args=(r, port, str(root), queue), daemon=True)
                       for r in range(world)], queue, timeout_s)
    again_after_a_crash(launch)
    return [torch.load(Path(root) / f"rank{r}.pt", weights_only=False) for r in range(world)]


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block (tiny matmuls: a second thread only waits, seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def needs_gpus(count: int):
    """Skip, saying why, when fewer than `count` GPUs are visible."""
    import pytest
    have = local_gpus()
    return pytest.mark.skipif(have < count, reason=f"needs {count} GPU(s), this machine shows {have}")


@functools.lru_cache(maxsize=None)
def warm_started(steps: int = 80) -> tuple[str, ...]:
    """`lathe train` overrides that start from the built-in model already warm-started with `steps` supervised
    steps (the default preset's warm start, built once per test session and step count). A run then skips
    3-9 s of warm start and is otherwise the same: the RL steps draw no random numbers the warm start moved
    (the same metrics, checked in tests/loop/test_ppo.py)."""
    from lathe.config import load_config
    from lathe.loop.setup import build_model, load_datasets
    from lathe.models.hf import load_tokenizer
    root = Path(tempfile.mkdtemp(prefix=f"lathe-warm{steps}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    cfg = load_config("default", [f"actor_rollout_ref.model.warm_start.steps={steps}",
                                  f"trainer.default_local_dir={root}"])
    tokenizer = load_tokenizer("builtin:tiny")
    build_model(cfg, tokenizer, load_datasets(cfg, tokenizer)[0], root, None, torch.device("cpu"))
    return (f"actor_rollout_ref.model.path={root / 'init_model'}", "actor_rollout_ref.model.tokenizer_path=builtin:tiny",
            "actor_rollout_ref.model.warm_start.steps=0", "critic.model.path=builtin:tiny")   # (the critic as before)


# Qwen2.5's chat template in brief: tools listed in the system turn (else a default system turn), tool answers joined
# into one user turn, ChatML markers.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call tools:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_style_tokenizer():
    """The built-in character tokenizer with ChatML markers (special) and `<tool_call>`/`</tool_call>` (added, not
    special, as in Qwen2.5's tokenizer) and `QWEN_TOOLS_TEMPLATE`."""
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])      # added, not special: as in Qwen2.5's tokenizer
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return tok


def worker_ppo_batch(worker, rollout_batch):
    """A PPO batch for an `ActorRolloutRefWorker`: `rollout_batch`'s 8 rows with old log-probs off the worker's own
    by noise (so the ratio is not 1), random advantages and the worker's reference log-probs."""
    batch = rollout_batch(rows=8, seed=1)
    g = torch.Generator().manual_seed(2)
    logp = worker.compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = (logp + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    batch["ref_log_prob"] = worker.compute_ref_log_prob(batch)["ref_log_prob"]
    return batch


def plan_of(cfg, device_count: int | None = None, **changes):
    """`lathe.config.run_plan(cfg, device_count)` with some facts replaced: a test that wants a reference (or none)
    whatever the config's KL keys say passes `needs_ref`; one that builds a one-process worker beside the ranks of a
    multi-device config passes `device_count=1`."""
    from dataclasses import replace

    from lathe.config import run_plan
    return replace(run_plan(cfg, device_count), **changes)


def tiny_reward_model(path, *, chat_template: str | None = None, seed: int = 0, family: str = "llama") -> str:
    """A tiny random `LlamaForSequenceClassification` (`family="qwen2"`: `Qwen2ForSequenceClassification`, its q/k/v
    biases and norms randomised) with one label and the built-in tokenizer saved in `path` (`chat_template` replaces
    the tokenizer's: a reward model that renders conversations its own way)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    torch.manual_seed(seed)
    config, cls = {"llama": (LlamaConfig, LlamaForSequenceClassification),
                   "qwen2": (Qwen2Config, Qwen2ForSequenceClassification)}[family]
    model = cls(config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                       pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)           # scores of order 1 (the default init gives ~0.02)
        if family != "llama":
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


RM_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}ASSISTANT: {% endif %}")     # a reward model's own chat rendering


def kill_after_checkpoint(run_dir, pid, step: int = 2) -> None:
    """SIGKILL process `pid` (a worker rank; or a callable that names it then) as soon as the run in `run_dir` has
    written its step-`step` checkpoint; the wait runs in a daemon thread of its own."""
    import os
    import signal
    import threading
    import time

    from lathe.ckpt.checkpoint import LATEST
    latest = Path(run_dir) / LATEST

    def kill() -> None:
        while not (latest.exists() and latest.read_text() == str(step)):
            time.sleep(0.01)
        os.kill(pid() if callable(pid) else pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()



def stop_once_shown(monkeypatch, shown, key: str = "critic/score/mean", also=()) -> None:
    """Let the next `lathe train` in this process stop as soon as what a test asserts of its metric `key` is shown:
    after each logged step, `shown(values)` (the values of `key` logged so far, as the run's metrics.jsonl holds them)
    decides whether the step just logged is the run's last. The run's `trainer.total_training_steps` stays its limit
    (and the length of its learning-rate schedule), and the steps it runs are those of the full run up to there: a
    test then asserts the same claim of the metrics, without the steps after it holds. (`also`: modules that
    imported `build_trainer` by name, whose name is replaced too.)"""
    from lathe.loop import setup

    build_trainer = setup.build_trainer

    def build_stopping(*args, **kwargs):
        t = build_trainer(*args, **kwargs)
        log, values = t.tracker.log, []

        def log_and_stop(metrics, step):
            log(metrics, step=step)
            if key in metrics:
                values.append(metrics[key])
                if shown(list(values)):
                    t.total_steps = min(t.total_steps, t.global_step)
        t.tracker.log = log_and_stop
        return t
    for module in (setup, *also):
        monkeypatch.setattr(module, "build_trainer", build_stopping)


def stop_once_risen(monkeypatch, rise: float, window: int = 10) -> None:
    """`stop_once_shown` for a reward-rise test: the run stops once the mean score of its last `window` steps is at
    least `rise` above that of its first `window` (two windows apart: from step 2 x `window` on), the test's assertion
    (the same sums, so that what stopped the run passes it)."""
    stop_once_shown(monkeypatch, lambda s: len(s) >= 2 * window
                    and sum(s[-window:]) / window >= sum(s[:window]) / window + rise)


def compiles_for_hopper(entry: str, timeout: int = 600) -> None:
    """Run `entry` ("module:function", importable from tests/) in a child process without Triton's interpreter (the
    tests run it in-process); the function compiles Triton kernels for sm_90 without a GPU (Triton's frontend, MLIR
    passes and ptxas: the type and shape checks the interpreter skips) and returns "compiled", or "SKIP: why"."""
    import os
    import subprocess
    import sys

    import pytest
    pytest.importorskip("triton", reason="triton is not installed")
    pytest.importorskip("triton.backends.nvidia", reason="triton has no CUDA backend here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module, function = entry.split(":")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([f"{root}/src", f"{root}/tests"])}
    done = subprocess.run([sys.executable, "-c", f"from {module} import {function} as c; print(c())"], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if "SKIP" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def compile_sm90(fn, signature: dict, constexprs: dict):
    """`triton.compile` of a @triton.jit function for sm_90 (signature: argument -> Triton type)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {**signature, **{n: "constexpr" for n in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))
