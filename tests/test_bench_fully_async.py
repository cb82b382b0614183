"""bench/fully_async.py builds its two `lathe train` command lines from bench/e2e.py's: an argument e2e gained later
(`--profile-step`) once broke it on the GPU machine before either run started. The bench is imported in a child
process, with bench/ on its path as when it runs, so nothing imported by the suite stands in for its modules."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fully_async
args = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--trigger", "3",
                               "--extra", "actor_rollout_ref.nccl_timeout=120"])
paths = {key: Path(sys.argv[2]) / key for key in ("model", "tokenizer", "parquet", "reward", "run")}
tool = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--workload", "tool", "--turns", "3"])
tp = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--workload", "tool", "--rollout-tp", "2"])
colocated = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--gpus", "1", "--modes", "sync,colocate",
                                    "--colocate", "1,2"])
tool_paths = {**paths, "tool": fully_async.write_tool(Path(sys.argv[2]), tool)}
sys.path.insert(0, sys.argv[2])
import bench_sleep_tool
from lathe.rollout.agent.parser import get_parser
calls = get_parser("hermes")("any text").calls
steps = [{"perf/time_per_step": 9.0, "trainer/idle_ratio": 0.5, "perf/total_num_tokens": 50},
         {"perf/time_per_step": 2.0, "trainer/idle_ratio": 0.25, "perf/total_num_tokens": 300},
         {"perf/time_per_step": 4.0, "trainer/idle_ratio": 0.5, "perf/total_num_tokens": 900}]
log = Path(sys.argv[2]) / "child.log"
log.write_text("01:47:15 lathe: memory plan\\n12:01:47:21 lathe: engine: KV cache shrinks from 8 to 6 blocks (x)\\n")
print(json.dumps({"shrinks": fully_async.kv_cache_shrinks(log),
                  "none": fully_async.kv_cache_shrinks(Path(sys.argv[2]) / "absent.log"),
                  "plain": fully_async.commands(paths, args), "tool": fully_async.commands(tool_paths, tool),
                  "tp": fully_async.commands(tool_paths, tp), "colocated": fully_async.commands(paths, colocated),
                  "calls": [c.name for c in calls], "busy": fully_async.summarize(steps, 1)["trainer_busy_s"],
                  "rate": fully_async.summarize(steps, 1)["timed_tokens_per_s"]}))
"""


def test_fully_async_builds_both_command_lines(tmp_path):
    done = subprocess.run([sys.executable, "-c", BUILD, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout.strip().splitlines()[-1])
    cmds = built["plain"]
    assert built["shrinks"] == ["engine: KV cache shrinks from 8 to 6 blocks (x)"] and built["none"] == []
    assert set(cmds) == {"sync", "async"}
    for cmd in cmds.values():
        assert cmd[1:4] == ["-m", "lathe", "train"]
        assert "actor_rollout_ref.rollout.ignore_eos=false" in cmd          # the long tail needs EOS honoured
        assert "actor_rollout_ref.nccl_timeout=120" in cmd
        assert not any(c.startswith("global_profiler.") for c in cmd)
    assert cmds["sync"][-2:] == ["trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path / 'run' / 'sync'}"]
    colocated = built["colocated"]       # --modes sync,colocate --colocate 1,2 --gpus 1: both on the sync run's GPU
    assert colocated["colocate_w2"][-4:] == ["trainer.n_gpus_per_node=1", "trainer.v1.trainer_mode=colocate_async",
                                             "trainer.v1.colocate_async.num_warmup_batches=2",
                                             f"trainer.default_local_dir={tmp_path / 'run' / 'colocate_w2'}"]
    assert "trainer.v1.colocate_async.num_warmup_batches=1" in colocated["colocate"]
    assert {"trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
            "async_training.trigger_parameter_sync_step=3"} <= set(cmds["async"])
    # --workload tool: both runs multi-turn with the bench's tool, whose module makes every turn call it
    mt = "actor_rollout_ref.rollout.multi_turn"
    for cmd in built["tool"].values():
        assert {f"{mt}.enable=true", f"{mt}.max_assistant_turns=3",
                f"{mt}.tool_config_path={tmp_path / 'bench_sleep_tool.json'}"} <= set(cmd)
    assert not any(c.startswith(f"{mt}.") for c in cmds["async"]) and built["calls"] == ["sleep"]
    assert abs(built["busy"] - (2.0 * 0.75 + 4.0 * 0.5)) < 1e-9     # the timed steps' trainer-busy seconds
    assert abs(built["rate"] - (300 + 900) / (2.0 + 4.0)) < 1e-9       # the timed steps' tokens over their wall
    # --rollout-tp 2: tensor-parallel replicas (sync: one of the 2 GPUs; async: a pool of 2 beside the trainer's)
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    assert not any(c.startswith(tp) for cmd in built["tool"].values() for c in cmd)
    assert f"{tp}=2" in built["tp"]["sync"] and {f"{tp}=2", "rollout.n_gpus_per_node=2"} <= set(built["tp"]["async"])


TWO_MODE = """
import importlib.util, json, statistics, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fully_async
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from lathe.data.dataset import RLDataset
from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models.hf import load_policy
from lathe.rollout.build import eos_token_ids
where = Path(sys.argv[2])
args = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--workload", "two-mode",
                               "--long-fraction", "0.25", "--median-response-len", "4", "--max-response-len", "24",
                               "--prompts", "4", "--steps", "1", "--prompt-len", "6"])
paths, described = fully_async.write_workload(where, args)
tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
prompts = [item["prompt_ids"] for item in RLDataset(str(paths["parquet"]), tok, max_prompt_length=6)]
model = load_policy(str(paths["model"]))          # as the trainer loads it (lathe's decoder, its generation_config)
engine = LatheEngine(model, eos_token_id=eos_token_ids(tok, model), block_size=8, num_kv_blocks=2048)
out = engine.generate(prompts, SamplingParams(n=32, temperature=1.0, max_tokens=24, seed=0))
spec = importlib.util.spec_from_file_location("reward", paths["reward"])
reward = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reward)
scores = [reward.compute_score("e2e", tok.decode(ids, skip_special_tokens=True), "0") for ids in out.token_ids]
hf = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
with torch.no_grad():
    first_hf = torch.softmax(hf(torch.tensor([prompts[0]])).logits[0, -1].double(), -1)
    first_lathe = torch.softmax(model.forward(torch.tensor([prompts[0]])).logits[0, -1].double(), -1)
chain = fully_async.chain_probabilities(model, described["stop_ids"])
opt = torch.optim.AdamW(model.train().parameters(), lr=1e-4)     # a hundred times the bench's lr (e2e's 1e-6)
batch = torch.tensor([prompts[0] + t[:5] for t in out.token_ids if len(t) >= 5][:16])
for advantages in torch.randn(3, len(batch), 1, generator=torch.Generator().manual_seed(0)):
    logits = model.forward(batch).logits[:, :-1]
    loss = -(torch.log_softmax(logits, -1).gather(-1, batch[:, 1:, None])[..., 0] * advantages).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
zeroed = ("v_proj.weight", "v_proj.bias", "o_proj.weight", "up_proj.weight", "down_proj.weight")
ids = fully_async.two_mode_ids(1000)
print(json.dumps({"last": sorted({p[-1] for p in prompts}), "pick": ids["pick"], "long_from": ids["long"].start,
                  "described": described, "lengths": [len(t) for t in out.token_ids],
                  "tokens": out.token_ids, "scores": scores,
                  "hf_long": first_hf[ids["long"].start:ids["long"].stop].sum().item(),
                  "hf_vs_lathe": ((first_hf - first_lathe).norm() / first_lathe.norm()).item(),
                  "chain": chain, "trained": fully_async.chain_probabilities(model, described["stop_ids"]),
                  "zeroed_max": max(p.abs().max().item() for n, p in model.named_parameters() if n.endswith(zeroed))}))
"""


def test_two_mode_workload_lengths(tmp_path):
    """--workload two-mode: the planted chain, run by lathe's engine on the written checkpoint, data and stop ids,
    gives two modes: a response's first token picks its half with P(long) = --long-fraction, long-mode responses run
    to the cap, short-mode ones stop with the target median; transformers reads the same distribution from the
    checkpoint, a few optimizer steps keep it, and the bench's reward function finds each response's mode and length
    from its text."""
    done = subprocess.run([sys.executable, "-c", TWO_MODE, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["last"] == [got["pick"]]                       # every prompt ends with the mode-picking token
    chain = got["chain"]
    assert abs(chain["first_long"] - 0.25) < 2e-3 and abs(got["hf_long"] - 0.25) < 2e-3 and got["hf_vs_lathe"] < 1e-4
    assert max(chain[key] for key in ("short_to_long", "long_to_short", "long_stop", "special", "first_special")) < 1e-6
    assert abs(chain["short_stop"] - got["described"]["short_stop_prob"]) < 1e-3
    long = [t[0] >= got["long_from"] for t in got["tokens"]]
    lengths = got["lengths"]
    assert len(lengths) == 20 * 32
    assert 0.18 < sum(long) / len(long) < 0.32                                   # --long-fraction 0.25
    assert all(n == 24 for n, is_long in zip(lengths, long) if is_long)          # the long mode runs to the cap
    assert all((t >= got["long_from"]) == is_long for ts, is_long in zip(got["tokens"], long) for t in ts)
    short = [n for n, is_long in zip(lengths, long) if not is_long]
    assert 3 <= statistics.median(short) <= 5                                    # --median-response-len 4
    assert sum(n == 24 for n in short) < 0.05 * len(short)
    # training leaves the zeroed projections at zero (their gradients are zero), so the chain holds through a run
    assert got["zeroed_max"] == 0.0 and abs(got["trained"]["first_long"] - 0.25) < 0.02
    for s, n, is_long in zip(got["scores"], lengths, long):
        assert s["long_mode"] == float(is_long) and s["long_len" if is_long else "short_len"] == n


STALENESS = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fully_async as fa
paths = {key: Path(sys.argv[2]) / key for key in ("model", "tokenizer", "parquet", "reward", "run")}
four = fa.parse_args(["--device", "cpu", "--shape", "tiny", "--split", "2+2,1+3", "--staleness", "1,2"])
errors = []
for split, tp in (("2+2,1+2", 1), ("1+3", 2), ("2-2", 1), ("0+4", 1), ("3+1", 1), ("2+2,2+2", 1)):
    try:
        fa.parse_splits(split, tp, 256)
    except SystemExit as e:
        errors.append(str(e))
print(json.dumps({"modes": {k: v[0] for k, v in fa.async_modes("1,2,0.5").items()},
                  "four": fa.commands(paths, four), "errors": errors}))
"""


def test_a_staleness_list_and_splits_run_async_once_per_value():
    """`--staleness 1,2`: one async run per value (async, async_s2) against the same synchronous run, so a single call
    measures what a deeper pipeline buys; `--split 2+2,1+3` the same per split of 4 devices, sync on all 4."""
    done = subprocess.run([sys.executable, "-c", STALENESS, str(ROOT / "bench"), "/tmp/x"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["modes"] == {"async": 1.0, "async_s2": 2.0, "async_s0.5": 0.5}
    four = got["four"]
    assert list(four) == ["sync", "async", "async_s2", "async_t1r3", "async_t1r3_s2"]
    assert "trainer.n_gpus_per_node=4" in four["sync"]
    for mode, (trainer, rollout, staleness) in {"async": (2, 2, 1.0), "async_s2": (2, 2, 2.0),
                                                "async_t1r3": (1, 3, 1.0), "async_t1r3_s2": (1, 3, 2.0)}.items():
        assert {f"trainer.n_gpus_per_node={trainer}", f"rollout.n_gpus_per_node={rollout}",
                f"async_training.staleness_threshold={staleness}",
                f"trainer.default_local_dir=/tmp/x/run/{mode}"} <= set(four[mode]), mode
    assert [next(i for i, words in enumerate(("as many devices", "whole replicas", "TRAINER+ROLLOUT", "--prompts",
                                              "twice")) if words in e) for e in got["errors"]] == [0, 1, 2, 1, 3, 4]
