"""Data-parallel attention's decode under CUDA graphs on 2 GPUs over NCCL (`lathe.engine.data_parallel`): each step's
graph agreed among the replicas, an idle replica replaying it with padding rows only, the experts' rows in one piece
(`LocalExperts._across_replicas_static`), against the same engines decoding eagerly. bf16: the experts' grouped
matmul (Hopper) is what lets a MoE model's decode be captured at all. Run on a host of 2+ Hopper GPUs:

    PYTHONPATH=src:tests python -m pytest -q -m gpu tests/engine/test_data_parallel_gpu.py
"""

from __future__ import annotations

import datetime
import gc
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.test_data_parallel import MORE
from helpers import free_port, needs_gpus, run_processes
from lathe.engine.data_parallel import engine_groups
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.tensor_parallel import shard_copy
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model
from models.lathe_tiny import save_hf

pytestmark = [pytest.mark.gpu, needs_gpus(2)]
JOIN_S = 300


def worker(rank: int, port: int, path: str, queue) -> None:
    """Replica `rank` of 2: its prompts (replica 1 stops after 5 tokens, then idles while replica 0 runs to 14), eager
    and under graphs, greedy and sampled."""
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=JOIN_S))
        tp, dp = engine_groups(1, 2)
        whole = load_lathe_model(path, torch.bfloat16, device=device)
        model = shard_copy(whole, torch.bfloat16, device, tp, expert_parallel_size=2, dp=dp)
        prompts = MORE[:4] if rank == 0 else MORE[4:]
        out = {}
        for eager in (True, False):
            # (replica 0 prefills 8 tokens a step: its prefill steps meet replica 1's decode steps, run eagerly)
            engine = LatheEngine(model, eos_token_id=None, num_kv_blocks=64, max_model_len=64, enforce_eager=eager,
                                 max_num_batched_tokens=8 if rank == 0 else 16384)
            runs = []
            for temperature in (0.0, 1.0):
                params = SamplingParams(n=2, temperature=temperature, top_p=0.9, max_tokens=14 if rank == 0 else 5,
                                        seed=3)
                got = engine.generate(prompts, params, first_index=0 if rank == 0 else 8)
                runs.append((got.token_ids, got.metrics["rollout/graph_captures"]))
            out[eager] = runs
            del engine       # its graphs hold the replicas' collectives: freed before the process group goes
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        gc.collect()                     # (an engine in a reference cycle)
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_data_parallel_attention_decodes_under_graphs_as_it_does_eagerly(tmp_path):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("a MoE model's decode graphs need the grouped matmul of a Hopper GPU (or later)")
    path = str(save_hf(tmp_path, "qwen3_moe")[0])
    ctx = mp.get_context("spawn")       # this process holds CUDA (the capability above): a forked child could not
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, path, queue), daemon=True) for r in range(2)]
    for rank, out in run_processes(procs, queue, 3 * JOIN_S).items():
        assert not isinstance(out, str), out
        (greedy_e, caps_e), (sampled_e, _) = out[True]
        (greedy_g, caps_g), (sampled_g, _) = out[False]
        assert caps_e == 0 and caps_g > 0, (rank, caps_e, caps_g)
        # the same rows through the same grouped matmuls: the same greedy tokens; sampled ones within bf16 ties
        assert greedy_g == greedy_e, rank
        same = sum(a == b for s, t in zip(sampled_g, sampled_e) for a, b in zip(s, t))
        assert same >= 0.8 * sum(map(len, sampled_e)), (rank, same)
