"""Fully asynchronous training against the synchronous colocated loop on the same devices, on a long-tail workload.

    python bench/fully_async.py [--shape 0.5b] [--steps 12] [--git-sha SHA] [--out bench/results/fully_async_<device>.json]
    python bench/fully_async.py --device cpu --shape tiny --steps 4 --warmup 1 --prompts 8 --n 2 --prompt-len 8 \
        --median-response-len 4 --max-response-len 32 --out /tmp/fully_async_smoke.json                # CPU smoke
    python bench/fully_async.py --workload tool [--turns 4 --tool-latency 0.5 --tool-answer-len 32]    # multi-turn
    python bench/fully_async.py --workload tool --rollout-tp 2 [--modes sync]     # on tensor-parallel replicas
    python bench/fully_async.py --workload two-mode [--long-fraction 0.1]  # most short, some to the cap (reasoning RL)
    python bench/fully_async.py --staleness 1,2      # the async run once per staleness_threshold (async, async_s2)
    python bench/fully_async.py --split 2+2,1+3      # 4 GPUs: sync on all 4, async once per split (async, async_t1r3)
    python bench/fully_async.py --gpus 1 --modes sync,colocate --colocate 1,2   # verl V1's colocate_async, 1 GPU

Two GPUs (or two CPU workers; `--split` for more), `lathe train` runs in child processes, exactly as a user runs
them:

- sync: `trainer.n_gpus_per_node=2`, the hybrid engine (each GPU an FSDP2 rank with its own engine, data-parallel
  rollout, the weights synced into the engines after every update), one optimizer step per RL step;
- async: `trainer.n_gpus_per_node=1 rollout.n_gpus_per_node=1`, the trainer on one GPU and lathe's engine on the
  other, weights broadcast between them (`--trigger` updates per sync, `--staleness`, partial rollout).

`--split T+R` (a comma list runs each) puts the async trainer on T devices and the rollout pool on R, and the
synchronous run on T + R (issue 47's 2+2, 1+3, 3+1 on 4 GPUs; a trainer of T > 1 devices is an FSDP2 mesh, and a
step's samples must divide over it: 3+1 needs --prompts 48 or 96 with --n 8). The first split's run is `async`.

`--colocate W` (a comma list runs each; mode `colocate`, with `--modes ...,colocate`): verl V1's colocated
asynchronous trainer on the synchronous run's devices (`trainer.v1.trainer_mode=colocate_async`, `num_warmup_batches`
W: the rollout runs W batches ahead and continues unfinished responses across steps, `lathe.loop.colocate_async`);
the first W is `colocate`, others `colocate_w<W>`. `--gpus G` sets the synchronous (and colocated) run's devices.

`--rollout-tp T` makes the engine replicas tensor-parallel (`rollout.tensor_model_parallel_size=T`): sync, one
replica of the 2 GPUs (T=2); async, a rollout pool of T GPUs beside the trainer's one (1 + T GPUs).

Both train the same `--steps` x `--prompts` prompts (`--n` samples each; async: `require_batches=1`,
`ppo_mini_batch_size=--prompts`, so the same optimizer steps on the same batch size).

The long tail: random-weight Qwen2.5 shapes sample near-uniformly random tokens, and the checkpoint's
generation_config lists `k = round(V ln 2 / median)` of the vocabulary's ids as end-of-sequence ids, so a response
stops at each token with probability about k/V: lengths are geometric with median `--median-response-len`, capped at
`--max-response-len` (default 8x the median: about 1 response in 256 reaches the cap, and every synchronous step waits
for the longest of its responses). The measured length distribution is in the JSON.

`--workload two-mode` (issue 47's mixture): most responses short, `--long-fraction` of them running to
`--max-response-len`, the shape of reasoning RL, where a minority of responses reach max_response_length and every
synchronous step waits for them. Random weights have no per-sequence mode, so the checkpoint carries a planted
two-state chain (`plant_two_modes`): the layers' value, up and output projections are zero (the layers still
compute, and training keeps them at zero), so each next token depends on the current one only, through its
embedding; the vocabulary is split into a short half and a long half, and a token's successor is uniform over its
own half (leaving it: about e^-20 per token). The k stop ids (generation_config) lie in the short half, k set so that
a short-mode response's length is geometric with median `--median-response-len`; the long half holds none, so a
long-mode response runs to the cap. Every prompt ends with one designated id whose successor is in the long half
with probability `--long-fraction`: the mode is drawn per response (each of the `--n` samples of a prompt on its
own). The bench's reward function keeps the same score and reads each response's mode (its first token's half) and
length from its text: the JSON's `length_modes` (per run, over all its steps) gives the long-mode share, the share at
the cap, each mode's mean length and the short mode's share within the median (about 1/2; the workload entry has the
expected short-mode mean). Qwen2.5 shapes only. CPU smoke: the geometric smoke's arguments with `--workload
two-mode --long-fraction 0.25`.

Reported per run: the median and total wall seconds per trained step after `--warmup` (`perf/time_per_step`: the
whole step in the synchronous loop; the time between two finished updates in the asynchronous one), tokens/s, the
response lengths, and for async the staleness, idle ratios, partial rollouts and weight-sync time. The speed-up is
sync seconds / async seconds over the timed steps. Beside it, its ceiling at this split: sync seconds over the async
trainer's busy seconds (each step less its idle share). With one trainer device the update takes about twice the
synchronous loop's (two devices), so a workload whose synchronous step is mostly update cannot reach 2.5x at 1+1
whatever the rollout side does: the ceiling says how far a run is from that bound and which side to work on.

`--workload tool` (issue 47's multi-turn tool workload): the same model, data and lengths, each response a
trajectory of the agent loop (`rollout.multi_turn`) of up to `--turns` model turns, each but the last followed by a
tool call that sleeps `--tool-latency` seconds in the loop's thread pool and answers `--tool-answer-len` words.
Random weights never write a tool call, so the harness shapes the trajectories, as bench/agent_rollout.py does: the
tool's module, written beside the data and loaded by every worker with the tool config, makes the `hermes` format's
parser find one call in every model turn. `--max-response-len` is the whole trajectory's budget (turns and answers);
a turn still ends at the stop ids (`--median-response-len`). Reported besides: the tool calls and turns per
trajectory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import (DENSE_SHAPES, REWARD_FILE, SHAPES, claim_workdir, default_workdir, device_name, git_sha,  # noqa: E402
                    run_child, slug, write_data, write_model, write_tokenizer)
from e2e import lathe_command  # noqa: E402


def long_tail_model(shape: str, where: Path, device: str, median: int) -> tuple[Path, int]:
    """e2e's random-weight checkpoint of `shape` plus a generation_config.json listing k stop ids (see above)."""
    base = write_model(shape, where, device)
    vocab = SHAPES[shape]["vocab_size"]
    k = max(1, round(vocab * math.log(2) / median))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1, k + 1))}))
    return base, k


# -- the two-mode workload (see the module docstring) ------------------------------------------------------------------
KAPPA = 10.0        # the half-keeping logit: a token's successor leaves its half with probability about e^(-2 KAPPA)


def two_mode_ids(vocab: int) -> dict:
    """The two-mode split of the ids: the short half [2, V/2) (its first ids are the stop ids), the long half
    [V/2, V-1), and outside both the tokenizer's specials 0 and 1 and `pick`, V-1: every prompt's last token, whose
    successor draws the response's mode."""
    half = vocab // 2
    return {"short": range(2, half), "long": range(half, vocab - 1), "pick": vocab - 1}


def two_mode_stops(vocab: int, median: int) -> int:
    """k, the stop ids (2 .. k+1) that make a short-mode response's length geometric with median `median`: each
    short-mode token stops with probability p = k / |short half| = 1 - 2^(-1/(median - 1/2)), so that P(length <=
    median - 1/2) = 1/2 (the median of a discrete length: about 0.55 of the responses within `median` at median 4,
    0.45 within median - 1)."""
    short = len(two_mode_ids(vocab)["short"])
    return min(short - 1, max(1, round(short * (1 - 2 ** (-1 / (median - 0.5))))))


def plant_two_modes(model, long_fraction: float, kappa: float = KAPPA) -> None:
    """Plant the two-state chain in a random-weight Qwen2.5-shaped `LatheCausalLM` (in place, under no_grad).

    Each layer's value, up and output projections (v_proj, o_proj, up_proj, down_proj) are zeroed, so the final
    hidden state is the final norm of the current token's embedding whatever came before; the layers still compute
    all they did (q, k and the gate stay random). Each of those projections then has a zero gradient (its input or
    its output passes through a zero matrix), so training leaves them at zero: the chain survives the run's updates
    but for the lr-sized drift of the embeddings and norms.

    Hidden dimension 0 carries the mode: +a in the long half's embeddings, -a in the short half's; dimension 1 is +a
    on every row but the specials' (0, 1: -a); dimension 2 is a on `pick`'s row, 0 elsewhere; the rest of every row
    is rescaled to the init's mean norm (= a), so every half's row has the same RMS. The final norm's weight is zero
    but for dimensions 0 and 1 (kappa * rms / a^2) and 2 (-2 kappa * rms / a^2): the logits from a half's token are
    2 kappa on its own half, 0 on the other, -kappa on the specials and about kappa on `pick` (lm_head rows = the
    embeddings, tied or copied), uniform within each half. `pick`'s dimension 0 is the b that puts its logits at
    about kappa +- x with P(long half) = `long_fraction`; dimension 2 puts its own at about -kappa (a row's logit
    on itself is the sum of g_d e_d^2: only a negative weight lowers it). Stop ids, being short-half ids, are reached
    only from the short half (their count sets the median: `two_mode_stops`)."""
    if not 0 < long_fraction < 1:
        raise ValueError(f"--long-fraction={long_fraction}: must lie strictly between 0 and 1")
    emb = model.model.embed_tokens.weight
    vocab, hidden = emb.shape
    ids = two_mode_ids(vocab)
    rest = emb[:, 3:].double()
    a = rest.norm(dim=1).mean().item()
    rest = rest / rest.norm(dim=1, keepdim=True) * a
    rms = (3 * a ** 2 / hidden) ** 0.5
    g = kappa * rms / a ** 2
    x = 0.5 * math.log(long_fraction * len(ids["short"]) / ((1 - long_fraction) * len(ids["long"])))
    y = x / (g * a)                             # b / rms(pick's row)
    if y ** 2 >= hidden:
        raise ValueError(f"--long-fraction={long_fraction}: too close to 0 or 1 for hidden size {hidden}")
    planted = torch.zeros(vocab, 3, dtype=torch.float64, device=emb.device)
    planted[ids["short"].start:ids["short"].stop, 0] = -a
    planted[ids["long"].start:ids["long"].stop, 0] = a
    planted[ids["pick"], 0] = y * (3 * a ** 2 / (hidden - y ** 2)) ** 0.5
    planted[:, 1] = a
    planted[:2, 1] = -a
    planted[ids["pick"], 2] = a
    rows = torch.cat([planted, rest], dim=1)
    emb.copy_(rows)
    if model.lm_head.weight is not emb:
        model.lm_head.weight.copy_(rows)
    model.model.norm.weight.zero_()
    model.model.norm.weight[:3] = torch.tensor([g, g, -2 * g], device=emb.device)
    for name, p in model.named_parameters():
        if name.endswith(("v_proj.weight", "v_proj.bias", "o_proj.weight", "up_proj.weight", "down_proj.weight")):
            p.zero_()


def chain_probabilities(model, stops: int, rows: int = 32) -> dict:
    """The planted chain's transition probabilities, computed from `model`'s weights (float32): P(long half) after
    `pick`; per token, P(stop) and P(leave the half) from short-half tokens (non-stop) and from long-half tokens
    (means over `rows` ids of each); P(0, 1 or `pick`) after `pick`, and its largest from either half's tokens.
    Exact while the layers add nothing to the residual stream (see `plant_two_modes`)."""
    emb = model.model.embed_tokens.weight.float()
    out, g = model.lm_head.weight.float(), model.model.norm.weight.float()
    ids = two_mode_ids(emb.shape[0])
    eps = model.config.rms_norm_eps

    def probs(tokens) -> torch.Tensor:
        e = emb[list(tokens)]
        return torch.softmax((e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * g) @ out.T, dim=-1)
    short, long = ids["short"], ids["long"]
    from_short = probs(torch.linspace(2 + stops, short.stop - 1, rows).long().tolist())
    from_long = probs(torch.linspace(long.start, long.stop - 1, rows).long().tolist())
    first = probs([ids["pick"]])[0]
    special = [0, 1, ids["pick"]]
    return {"first_long": first[long.start:long.stop].sum().item(), "first_special": first[special].sum().item(),
            "short_stop": from_short[:, 2:2 + stops].sum(-1).mean().item(),
            "short_to_long": from_short[:, long.start:long.stop].sum(-1).mean().item(),
            "long_stop": from_long[:, 2:2 + stops].sum(-1).mean().item(),
            "long_to_short": from_long[:, short.start:short.stop].sum(-1).mean().item(),
            "special": torch.cat([from_short, from_long])[:, special].sum(-1).max().item()}


def two_mode_model(shape: str, where: Path, device: str, median: int, long_fraction: float) -> tuple[Path, int]:
    """write_model's random-weight checkpoint of `shape` with the two-mode chain planted, and a generation_config.json
    listing the k stop ids 2 .. k+1 (`two_mode_stops`)."""
    if shape not in DENSE_SHAPES:
        raise ValueError(f"--workload two-mode --shape {shape}: the chain is planted in Qwen2.5 shapes only "
                         f"({', '.join(DENSE_SHAPES)})")
    base = write_model(shape, where, device, name=f"two-mode-f{long_fraction:g}",
                       edit=lambda model: plant_two_modes(model, long_fraction))
    k = two_mode_stops(SHAPES[shape]["vocab_size"], median)
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(2, k + 2))}))
    return base, k


TWO_MODE_REWARD = '''LONG_FROM, MEDIAN = {long_from}, {median}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """common.REWARD_FILE's score (the length in characters, folded into [0, 1)), plus the length split
    (bench/fully_async.py --workload two-mode): every token is a word `w<id>` (the stop ids too), and a response's
    mode is its first token's half."""
    words = solution_str.split()
    mode = "long" if words and int(words[0][1:]) >= LONG_FROM else "short"
    split = {{"long_mode": float(mode == "long"), f"{{mode}}_len": float(len(words))}}
    if mode == "short":
        split["short_within_median"] = float(len(words) <= MEDIAN)
    return {{"score": (len(solution_str) % 97) / 97.0, **split}}
'''


TOOL_MODULE = '''"""bench/fully_async.py --workload tool: a tool that sleeps and answers (written by the bench).
Importing it makes the `hermes` parser find one call in every model turn (random weights never write one)."""
import time

from lathe.rollout.agent import parser
from lathe.rollout.agent.tools import BaseTool

LATENCY_S, ANSWER = {latency}, {answer!r}


def every_turn_calls(text):
    return parser.ParsedTurn(text, [parser.ToolCall("sleep", {{}})])


parser.PARSERS["hermes"] = every_turn_calls


class SleepTool(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(LATENCY_S)
        return ANSWER
'''


def write_tool(where: Path, args) -> Path:
    """The tool workload's tool module and verl-shaped tool config (see the module docstring); the config's path."""
    module = where / "bench_sleep_tool.py"
    answer = " ".join(f"w{2 + i % 97}" for i in range(args.tool_answer_len))
    module.write_text(TOOL_MODULE.format(latency=args.tool_latency, answer=answer))
    schema = {"type": "function", "function": {"name": "sleep", "description": "sleeps, then answers",
                                               "parameters": {"type": "object", "properties": {}, "required": []}}}
    config = where / "bench_sleep_tool.json"        # (YAML is a superset of JSON)
    config.write_text(json.dumps({"tools": [{"class_name": f"{module}:SleepTool", "config": {"type": "native"},
                                             "tool_schema": schema}]}))
    return config


def workload_keys(paths: dict, args) -> list[str]:
    """The `lathe train` keys of `--workload` (none for the geometric single-turn one)."""
    if args.workload != "tool":
        return []
    mt = "actor_rollout_ref.rollout.multi_turn"
    return [f"{mt}.enable=true", f"{mt}.format=hermes", f"{mt}.tool_config_path={paths['tool']}",
            f"{mt}.max_assistant_turns={args.turns}", f"{mt}.tool_timeout={max(30.0, 4 * args.tool_latency)}"]


def commands(paths: dict, args) -> dict[str, list[str]]:
    """The `lathe train` command lines: e2e's (same model, data, reward, batch) with EOS honoured, then each mode's
    placement (later overrides win): sync on all of a split's devices, each async run on its split."""
    splits = parse_splits(args.split, args.rollout_tp, args.prompts * args.n)
    # (without --split: sync on 2 devices, as before splits existed, also beside a 1 + TP async run)
    args.response_len = args.max_response_len
    args.gpus = args.gpus or (sum(splits[0]) if args.split else 2)
    args.profile_step, args.profile_stack = 0, False      # e2e's profiler knobs, which this bench does not offer
    base = [*lathe_command(args.shape, paths, args), "actor_rollout_ref.rollout.ignore_eos=false",
            *workload_keys(paths, args)]
    run = paths["run"]
    tp = [f"actor_rollout_ref.rollout.tensor_model_parallel_size={args.rollout_tp}"] if args.rollout_tp > 1 else []
    sync = [*base, *tp, f"trainer.n_gpus_per_node={args.gpus}", f"trainer.default_local_dir={run / 'sync'}"]
    out = {"sync": sync}
    for mode, (staleness, (trainer, rollout)) in async_modes(args.staleness, splits).items():
        out[mode] = [*base, *tp, f"trainer.n_gpus_per_node={trainer}", "rollout.nnodes=1",
                     f"rollout.n_gpus_per_node={rollout}", "actor_rollout_ref.hybrid_engine=false",
                     "data.train_batch_size=0", "data.gen_batch_size=1", "async_training.require_batches=1",
                     f"async_training.trigger_parameter_sync_step={args.trigger}",
                     f"async_training.staleness_threshold={staleness}", "async_training.partial_rollout=true",
                     f"trainer.default_local_dir={run / mode}"]
    colocated = "colocate" in args.modes.split(",")
    for i, warmup in enumerate(int(w) for w in args.colocate.split(",") if colocated):
        mode = "colocate" if i == 0 else f"colocate_w{warmup}"
        out[mode] = [*base, *tp, f"trainer.n_gpus_per_node={args.gpus}", "trainer.v1.trainer_mode=colocate_async",
                     f"trainer.v1.colocate_async.num_warmup_batches={warmup}",
                     f"trainer.default_local_dir={run / mode}"]
    return out


def parse_splits(split: str | None, rollout_tp: int, samples: int | None = None) -> list[tuple[int, int]]:
    """`--split` (T+R, or a comma list of them) as (trainer devices, rollout devices) pairs; none given: 1 + the
    rollout's TP. Every split holds as many devices (the synchronous run uses them all), none twice, the rollout's TP
    divides each rollout pool, and each trainer's devices divide a step's `samples` (its mini-batch)."""
    pairs = []
    for part in (split or f"1+{rollout_tp}").split(","):
        try:
            trainer, rollout = (int(x) for x in part.split("+"))
        except ValueError:
            raise SystemExit(f"--split {split}: each split is TRAINER+ROLLOUT devices, e.g. 2+2 or 1+3,2+2") from None
        if trainer < 1 or rollout < 1 or rollout % rollout_tp:
            raise SystemExit(f"--split {part}: both pools need a device, and the rollout's {rollout} devices must "
                             f"be whole replicas of --rollout-tp {rollout_tp}")
        if samples and samples % trainer:
            raise SystemExit(f"--split {part}: {samples} samples a step (--prompts x --n) do not divide over "
                             f"{trainer} trainer devices; choose --prompts so that they do")
        if (trainer, rollout) in pairs:
            raise SystemExit(f"--split {split}: {part} twice")
        pairs.append((trainer, rollout))
    if len({t + r for t, r in pairs}) > 1:
        raise SystemExit(f"--split {split}: every split must use as many devices (the synchronous run uses them all)")
    return pairs


def async_modes(staleness: str, splits: list[tuple[int, int]] | None = None) -> dict[str, tuple[float, tuple]]:
    """The async runs, {name: (staleness_threshold, split)}: each `--staleness` value (one, or a comma list) on each
    `--split`; the first of both is `async`, another staleness adds `_s<value>`, another split `_t<T>r<R>` (one call
    measures the pipeline depth's and the split's trade-offs against the same synchronous run)."""
    values = [float(v) for v in str(staleness).split(",")]
    if len(set(values)) < len(values):
        raise SystemExit(f"--staleness {staleness}: a value twice")
    splits = splits or [(1, 1)]
    return {"async" + ("" if j == 0 else f"_t{t}r{r}") + ("" if i == 0 else f"_s{v:g}"): (v, (t, r))
            for j, (t, r) in enumerate(splits) for i, v in enumerate(values)}


def write_workload(where: Path, args) -> tuple[dict, dict]:
    """`--workload`'s model, data, reward (and tool) files: the `paths` the command lines name, and what the JSON's
    workload entry adds (the stop ids; the tool's or the two modes' settings)."""
    vocab = SHAPES[args.shape]["vocab_size"]
    rows, reward, last = args.prompts * (args.steps + 4), REWARD_FILE, None
    if args.workload == "two-mode":
        model, k = two_mode_model(args.shape, where, args.device, args.median_response_len, args.long_fraction)
        ids = two_mode_ids(vocab)
        reward = TWO_MODE_REWARD.format(long_from=ids["long"].start, median=args.median_response_len)
        last, p = ids["pick"], k / len(ids["short"])
        described = {"stop_ids": k, "long_fraction": args.long_fraction, "kappa": KAPPA, "short_stop_prob": p,
                     "short_len_mean_expected": (1 - (1 - p) ** args.max_response_len) / p}
    else:
        model, k = long_tail_model(args.shape, where, args.device, args.median_response_len)
        described = {"stop_ids": k, **({k_: getattr(args, k_) for k_ in ("turns", "tool_latency", "tool_answer_len")}
                                       if args.workload == "tool" else {})}
    parquet, _ = write_data(where, rows=rows, prompt_len=args.prompt_len, vocab_size=vocab, last_word=last)
    (where / "reward.py").write_text(reward)
    paths = {"model": model, "tokenizer": write_tokenizer(vocab, where), "parquet": parquet,
             "reward": where / "reward.py", "run": where / f"run-{args.shape}-{args.workload}"}
    if args.workload == "tool":
        paths["tool"] = write_tool(where, args)
    return paths, described


def length_modes(steps: list[dict]) -> dict:
    """The two-mode workload's measured split over all the run's steps (means of the steps' figures; none for the
    other workloads): the long-mode share (by each response's first token), the share at the cap, each mode's mean
    length, and the short mode's share within `--median-response-len` (about 1/2 when its median is the target)."""
    figures = {"long_fraction": "reward_extra/long_mode/mean", "clip_ratio": "response_length/clip_ratio",
               "long_len_mean": "reward_extra/long_len/mean", "short_len_mean": "reward_extra/short_len/mean",
               "short_within_median": "reward_extra/short_within_median/mean"}
    if not any(figures["long_fraction"] in s for s in steps):
        return {}
    return {"length_modes": {name: statistics.mean(s[key] for s in steps if key in s)
                             for name, key in figures.items() if any(key in s for s in steps)}}


def summarize(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:] or steps[-1:]
    walls = [s["perf/time_per_step"] for s in timed]
    keys = ("response_length/mean", "response_length/max", "response_length/clip_ratio", "perf/throughput",
            "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "timing_s/param_sync",
            "trainer/idle_ratio", "trainer/idle_staleness_ratio", "rollouter/idle_ratio", "fully_async/staleness/mean",
            "fully_async/staleness/max",
            "fully_async/partial/partial_ratio", "fully_async/sync/send_s", "fully_async/sync/interrupted",
            "colocate_async/interrupted", "training/off_policy/trajectory_spans/mean",
            "training/off_policy/trajectory_staleness_worst/mean", "timing_s/rollout_wake_up",
            "timing_s/rollout_sleep",
            "agent/tool_calls/mean", "num_turns/mean", "timing_s/agent_loop")
    # the trainer's busy seconds (async: the step less its idle share): no schedule of the rollout side can make the
    # timed steps shorter than this, so sync seconds over it bound the speed-up at this split
    busy = (sum(s["perf/time_per_step"] * (1 - s["trainer/idle_ratio"]) for s in timed)
            if all("trainer/idle_ratio" in s for s in timed) else None)
    # tokens (prompt + response) over the timed wall: a long tail's responses reach the async trainer later than the
    # synchronous loop's, so the two timed windows hold different token counts and per-step times alone mislead
    tokens = (sum(s["perf/total_num_tokens"] for s in timed) if all("perf/total_num_tokens" in s for s in timed)
              else None)
    return {"steps_timed": len(timed), "step_wall_s_median": statistics.median(walls), "timed_wall_s": sum(walls),
            "timed_tokens": tokens, "timed_tokens_per_s": tokens / sum(walls) if tokens else None,
            "trainer_busy_s": busy,
            "step_wall_s_all": [s.get("perf/time_per_step") for s in steps],
            "trainer_idle_all": [s.get("trainer/idle_ratio") for s in steps],       # a stalled step shows here
            "medians": {k: statistics.median(s[k] for s in timed) for k in keys if all(k in s for s in timed)},
            "max_memory_allocated_gb": max((s.get("perf/max_memory_allocated_gb", 0) for s in steps), default=None)}


def kv_cache_shrinks(log: Path) -> list[str]:
    """The engine's wake-up warnings in a child's log: each time its KV cache came back smaller than it was
    sized, with where the device's memory was (memory another phase kept cached)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line.split("lathe: ", 1)[-1] for line in text.splitlines() if "KV cache shrinks" in line]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (and ppo_mini_batch_size)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median-response-len", type=int, default=256)
    p.add_argument("--max-response-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compilation, the async pipeline filling)")
    p.add_argument("--trigger", type=int, default=2, help="async_training.trigger_parameter_sync_step")
    p.add_argument("--staleness", default="1", help="async_training.staleness_threshold; a comma list (1,2) runs the "
                   "async mode once per value (async, async_s2, ...) against the same synchronous run")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--workload", default="geometric", choices=("geometric", "tool", "two-mode"),
                   help="geometric: single-turn long tail; tool: multi-turn trajectories with tool calls; two-mode: "
                        "most responses short (geometric), --long-fraction of them to --max-response-len")
    p.add_argument("--long-fraction", type=float, default=0.1, help="two-mode workload: the long mode's share")
    p.add_argument("--turns", type=int, default=4, help="tool workload: model turns per trajectory (at most)")
    p.add_argument("--tool-latency", type=float, default=0.5, help="tool workload: seconds a tool call sleeps")
    p.add_argument("--tool-answer-len", type=int, default=32, help="tool workload: words of a tool answer")
    p.add_argument("--rollout-tp", type=int, default=1, choices=(1, 2),
                   help="rollout.tensor_model_parallel_size (without --split: sync one replica of the 2 GPUs, async "
                        "1 + it GPUs; with --split: replicas of it in each pool)")
    p.add_argument("--split", default=None, help="the async runs' devices, TRAINER+ROLLOUT (e.g. 2+2), or a comma list "
                   "(2+2,1+3: one async run each, named async, async_t1r3, ...); sync runs on as many; default "
                   "1+<rollout-tp>")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--gpus", type=int, default=None, help="the synchronous and colocated runs' devices (default: 2, "
                   "or a split's)")
    p.add_argument("--colocate", default="1", help="colocate mode: trainer.v1.colocate_async.num_warmup_batches; a "
                   "comma list runs each (colocate, colocate_w<W>)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--workdir", default=default_workdir("lathe-fully-async"))
    p.add_argument("--git-sha", default=None, help="the commit measured, as your checkout names it")
    p.add_argument("--extra", nargs="*", default=[], metavar="key=value",
                   help="more lathe train keys for both runs (e.g. actor_rollout_ref.nccl_timeout=120)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    where = claim_workdir(Path(args.workdir))
    (where / "logs").mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    paths, described = write_workload(where, args)
    name = device_name(torch.device(args.device))
    kind = ("" if args.workload == "geometric" else f"{args.workload.replace('-', '_')}_") + (
        f"tp{args.rollout_tp}_" if args.rollout_tp > 1 else "") + (
        f"split{args.split.replace('+', 'p').replace(',', '_')}_" if args.split else "")
    out = Path(args.out or ROOT / "bench" / "results" / f"fully_async_{kind}{slug(name)}.json")
    result = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "workload": {**{k_: getattr(args, k_) for k_ in ("shape", "prompts", "n", "prompt_len", "steps", "warmup",
                                                               "median_response_len", "max_response_len", "trigger",
                                                               "staleness", "workload", "rollout_tp", "split")},
                           "stop_ids": described.pop("stop_ids"), "vocab": vocab, **described},
              "runs": {}}
    for mode, cmd in commands(paths, args).items():
        if mode.split("_")[0] not in args.modes.split(","):      # `async` selects every staleness and split run
            continue
        metrics = paths["run"] / mode / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        rc, wall = run_child(cmd, where / "logs" / f"{mode}.log", args.timeout)
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        result["runs"][mode] = {"command": " ".join(cmd[1:]), "returncode": rc, "wall_s": wall,
                                **(summarize(steps, args.warmup) if steps else {}), **length_modes(steps),
                                "kv_cache_shrinks": kv_cache_shrinks(where / "logs" / f"{mode}.log")}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    s = result["runs"].get("sync", {}).get("timed_wall_s")
    for mode in [m for m in result["runs"] if m.startswith(("async", "colocate"))]:
        a, busy = (result["runs"][mode].get(k) for k in ("timed_wall_s", "trainer_busy_s"))
        kind = "async" if mode.startswith("async") else "colocate"
        suffix = mode[len(kind):]                  # "" for the first staleness, split or warm-up, "_s2", "_t2r2"
        if s and a:
            result[f"speedup_{kind}_vs_sync{suffix}"] = s / a
        rates = [result["runs"][m].get("timed_tokens_per_s") for m in ("sync", mode)]
        if all(rates):           # the same ratio per token: fair when the timed windows hold different lengths
            result[f"speedup_tokens_per_s{'' if kind == 'async' else '_colocate'}{suffix}"] = rates[1] / rates[0]
        if s and busy:  # the trainer-bound ceiling: its update on its devices against the whole synchronous step
            result[f"speedup_ceiling_trainer_bound{suffix}"] = s / busy
    out.write_text(json.dumps(result, indent=2))
    for mode, r in result["runs"].items():
        print(f"{mode:>8}: rc {r['returncode']}, {r.get('step_wall_s_median', float('nan')):.2f} s/step (median), "
              f"{r.get('timed_wall_s', float('nan')):.1f} s over {r.get('steps_timed', 0)} steps, "
              f"response length {r.get('medians', {}).get('response_length/mean', float('nan')):.0f} mean")
        if "length_modes" in r:
            print("       " + ", ".join(f"{key} {value:.3g}" for key, value in r["length_modes"].items()))
    for key in [k for k in result if k.startswith(("speedup_async_vs_sync", "speedup_colocate_vs_sync"))]:
        kind = key.split("_")[1]
        suffix = key[len(f"speedup_{kind}_vs_sync"):]
        ceiling = result.get(f"speedup_ceiling_trainer_bound{suffix}") if kind == "async" else None
        per_token = result.get(f"speedup_tokens_per_s{'' if kind == 'async' else '_colocate'}{suffix}")
        print(f"speed-up ({kind}{suffix} / sync): {result[key]:.2f}x"
              + (f", {per_token:.2f}x in tokens/s" if per_token else "")
              + (f" (trainer-bound ceiling {ceiling:.2f}x)" if ceiling else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
