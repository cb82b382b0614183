"""Multi-turn rollout throughput of the agent loop (`lathe.rollout.agent`) on one GPU, against turn-synchronous batches.

    python bench/agent_rollout.py [--model 0.5b] [--prompts 32] [--n 8] [--turns 4] [--out ...]
    python bench/agent_rollout.py --device cpu --model tiny --prompts 2 --n 2 --turn-tokens 8   # smoke test

A random-weight Qwen2.5 shape in bf16 on lathe's engine (the path `lathe train` rolls out with). Random weights never
write tool calls, so the trajectories are shaped by the harness, the rest is the real loop:
- a model turn ends at a stop token: every `--turn-tokens`-th token id is one, so turns have natural, geometric
  lengths with mean `--turn-tokens` (a random model samples nearly uniformly over the vocabulary);
- every turn "calls" a tool (the parser is replaced by one that always finds a call) until `--turns` model turns;
- the tool sleeps `--tool-latency` seconds in the loop's thread pool and answers; its rendered answer is
  `--tool-tokens` tokens (the renderer is replaced by one that appends that many tokens).
Reported: trajectories/s, model tokens/s (the tokens the policy samples), all tokens/s, the prefix-cache hit rate of
later turns, and the same trajectories run turn-synchronously (each turn one `generate` call over the live
trajectories, then every tool call of the turn, in parallel, then the next turn: what a batch-per-turn rollout does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import SHAPES, build_hf, device_name, git_sha, slug, sync  # noqa: E402

from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402
from lathe.rollout.agent.loop import AgentLoop, AgentSettings  # noqa: E402
from lathe.rollout.agent.parser import ParsedTurn, ToolCall  # noqa: E402
from lathe.rollout.agent.tools import BaseTool, ToolSet  # noqa: E402

SHAPES = {**SHAPES, "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)}


class SleepTool(BaseTool):
    latency = 0.05

    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(self.latency)
        return "ok"


class FixedRenderer:
    """Appends `tokens` filler tokens per tool turn (a rendered tool answer plus the next generation prompt)."""

    def __init__(self, tokens: int):
        self.delta = [11] * tokens

    def stop_ids(self):
        return []

    def close_turn(self, turn_ids):
        return []

    def messages_delta(self, messages):
        return list(self.delta)


def always_calls(text: str) -> ParsedTurn:
    return ParsedTurn("", [ToolCall("sleep", {})], [])


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (count, length), generator=g).tolist()


class StepTimer:
    """Wall time of each `engine.step` while installed, split by the kind of step the scheduler ran."""

    def __init__(self, engine):
        self.engine, self.step, self.times = engine, engine.step, {"prefill": [], "decode": []}

    def __enter__(self):
        def timed():
            before = dict(self.engine.scheduler.num_steps)
            t0 = time.perf_counter()
            try:
                return self.step()
            finally:
                kind = next((k for k, v in self.engine.scheduler.num_steps.items() if v != before[k]), None)
                if kind:
                    self.times[kind].append(time.perf_counter() - t0)
        self.engine.step = timed
        return self

    def __exit__(self, *exc):
        del self.engine.step

    def summary(self) -> dict:
        return {k: {"steps": len(v), "seconds": sum(v), "mean_ms": 1e3 * sum(v) / max(1, len(v))}
                for k, v in self.times.items()}


def agent_loop_run(engine, prompts, params, settings, args, device) -> dict:
    tools = ToolSet([SleepTool({}, {"type": "function", "function": {"name": "sleep", "parameters": {}}})])
    loop = AgentLoop(engine, tokenizer=_NoDecode(), settings=settings, tools=tools, parse=always_calls,
                     renderer=FixedRenderer(args.tool_tokens))
    sync(device)
    start = time.perf_counter()
    with StepTimer(engine) as timer:
        out = loop.generate(prompts, params)
        sync(device)
    seconds = time.perf_counter() - start
    model = sum(sum(m) for m in out.loss_masks)
    return {"seconds": seconds, "trajectories": len(out.token_ids), "trajectories_per_s": len(out.token_ids) / seconds,
            "model_tokens": model, "model_tok_s": model / seconds,
            "all_tokens_s": sum(len(t) for t in out.token_ids) / seconds,
            "turns_mean": sum(out.num_turns) / len(out.num_turns), "tool_calls": sum(out.tool_calls),
            "engine_steps": timer.summary(),
            "prefix_hit_rate": out.metrics.get("agent/prefix_hit_rate"), "preemptions":
            out.metrics.get("rollout/num_preemptions"), "turn_lengths": _turn_lengths(out)}


def _turn_lengths(out) -> dict:
    lengths = []
    for mask in out.loss_masks:
        run = 0
        for m in mask + [0]:
            if m:
                run += 1
            elif run:
                lengths.append(run)
                run = 0
    return {"mean": sum(lengths) / max(1, len(lengths)), "max": max(lengths, default=0), "turns": len(lengths)}


class _NoDecode:
    def decode(self, ids, skip_special_tokens=False):
        return ""


def turn_synchronous_run(engine, prompts, params, settings, args, device) -> dict:
    """Each turn: one generate over the live trajectories; then all of the turn's tool calls at once."""
    trajs = [{"prompt": p, "ids": [], "model": 0, "turns": 0} for p in prompts for _ in range(params.n)]
    pool = ThreadPoolExecutor(max_workers=settings.max_concurrent_tool_calls)
    sync(device)
    start = time.perf_counter()
    live = list(range(len(trajs)))
    timer = StepTimer(engine).__enter__()
    for turn in range(args.turns):
        budget = [settings.response_length - len(trajs[i]["ids"]) for i in live]
        p = SamplingParams(n=1, temperature=1.0, max_tokens=max(budget), seed=turn,
                           stop_token_ids=params.stop_token_ids)
        out = engine.generate([trajs[i]["prompt"] + trajs[i]["ids"] for i in live], p)
        for i, ids in zip(live, out.token_ids):
            trajs[i]["ids"] += ids
            trajs[i]["model"] += len(ids)
            trajs[i]["turns"] += 1
        if turn == args.turns - 1:
            break
        list(pool.map(lambda _: time.sleep(SleepTool.latency), live))
        for i in live:
            trajs[i]["ids"] += [11] * args.tool_tokens
    sync(device)
    seconds = time.perf_counter() - start
    timer.__exit__()
    model = sum(t["model"] for t in trajs)
    return {"seconds": seconds, "engine_steps": timer.summary(), "trajectories_per_s": len(trajs) / seconds,
            "model_tokens": model, "model_tok_s": model / seconds, "all_tokens_s": sum(len(t["ids"]) for t in trajs) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=128, help="mean model tokens per turn")
    ap.add_argument("--tool-tokens", type=int, default=64, help="tokens of a rendered tool answer")
    ap.add_argument("--tool-latency", type=float, default=0.05, help="seconds a tool call takes")
    ap.add_argument("--response-length", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefill-interval", type=int, default=16, help="the agent loop's prefill batching (1 = off)")
    ap.add_argument("--no-park", action="store_true",
                    help="hybrid models: a next turn computes its whole conversation again (the A/B of parked turns)")
    ap.add_argument("--no-turn-synchronous", action="store_true", help="run the agent loop only (A/Bs of the loop)")
    ap.add_argument("--padded-cached-prefill", action="store_true",
                    help="continued sequences' prefill attention by masked SDPA over a padded batch (the form before "
                         "flash over packed contexts; the A/B)")
    ap.add_argument("--torch-profile", action="store_true", help="add a torch.profiler table of a short agent-loop run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    SleepTool.latency = args.tool_latency
    shape = SHAPES[args.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model == "tiny":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        hf = Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=8192)).to(device, dtype)
    else:
        hf = build_hf(args.model, device, dtype)
    model = lathe_from_transformers(hf.eval()).eval()
    del hf
    vocab = shape["vocab_size"]
    stops = list(range(0, vocab, args.turn_tokens))
    trajectories = args.prompts * args.n
    engine = LatheEngine(model, eos_token_id=None, max_num_seqs=trajectories,
                         max_model_len=args.prompt_len + args.response_length,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    engine.park_finished = engine.park_finished and not args.no_park
    if args.padded_cached_prefill:
        engine.runner.cached_backend = "sdpa"
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, 0)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_length, seed=0, stop_token_ids=stops)
    settings = AgentSettings(response_length=args.response_length, max_assistant_turns=args.turns,
                             max_concurrent_tool_calls=64, prefill_interval=args.prefill_interval)
    agent_loop_run(engine, prompts[:2], params, settings, args, device)            # warm-up: graphs, kernels
    runs = {"agent_loop": [], "turn_synchronous": []}
    for _ in range(args.repeats):
        runs["agent_loop"].append(agent_loop_run(engine, prompts, params, settings, args, device))
        if not args.no_turn_synchronous:
            runs["turn_synchronous"].append(turn_synchronous_run(engine, prompts, params, settings, args, device))
        print({k: round(v[-1]["trajectories_per_s"], 2) for k, v in runs.items() if v}, flush=True)
    profile = None
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            agent_loop_run(engine, prompts[:8], params, settings, args, device)
        profile = {key: prof.key_averages().table(sort_by=key, row_limit=25)
                   for key in ("self_cpu_time_total",) + (("self_cuda_time_total",) if device.type == "cuda" else ())}
    name = device_name(device)
    best = {k: max(v, key=lambda r: r["trajectories_per_s"]) for k, v in runs.items() if v}
    result = {"bench": "agent_rollout", "device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_sha": git_sha(), "torch": torch.__version__, "args": vars(args), "model": args.model,
              "engine": {"kv_blocks": engine.kv_cache.num_blocks, "block_size": engine.kv_cache.block_size,
                         "cuda_graphs": engine.runner.graphs is not None, "park_finished": engine.park_finished,
                         "cached_prefill": engine.runner.cached_backend},
              "runs": runs, "best": best, "torch_profile": profile,
              "speedup_vs_turn_synchronous": best["agent_loop"]["trajectories_per_s"]
              / best["turn_synchronous"]["trajectories_per_s"] if "turn_synchronous" in best else None}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"agent_rollout_{slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"best": best, "speedup": result["speedup_vs_turn_synchronous"]}, indent=2))


if __name__ == "__main__":
    main()
