"""The judge worker: a generative reward model (an LLM judge) served by lathe's engine, beside the actor.

Built from `reward_model.*` when `reward_model.judge.enable` (`lathe.config.schema_judge`): the causal LM of
`reward_model.model.path` (an architecture lathe's decoder runs) and its own tokenizer, in
`reward_model.rollout.dtype` on an accelerator (float32 on the CPU), under a `LatheEngine` sized by
`reward_model.rollout.*` (`lathe.rollout.build.build_engine`, the rollout's own builder).

`compute_rm_score(batch)`: each row's judge prompt is `judge.prompt_template` with the row's question (the prompt's
last user message), its response (decoded with the policy's tokenizer, special tokens dropped) and its ground truth;
sent through the judge tokenizer's chat template as one user message (`judge.apply_chat_template`), tokenized with
the judge's tokenizer. All prompts of the call go to the engine at once (continuous batching), greedy or sampled
as `reward_model.rollout.{do_sample,temperature,top_k,top_p}` say, at most `response_length` tokens each. A
prompt longer than `rollout.prompt_length` is not judged. `lathe.reward.judge.parse_verdict` reads each answer; a
verdict that does not parse, and a prompt not judged, score `judge.default_score` and are counted (the first
failing answer is logged once per call).

Placement (colocated, the synchronous loop): every rank holds a whole judge and judges its share of the rows. On a
GPU with `rollout.free_cache_engine` the judge's KV cache exists only while judging (`LatheEngine.sleep`/`wake_up`,
as the rollout's), and with `reward_model.model.fsdp_config.param_offload` its weights wait in pinned host memory
between calls (`HostWeights`, as the teacher's), so training has the device to itself. A sampled judge draws with
a seed made of `rollout.seed` and the call's judge prompts: a rank's share of the rows samples otherwise than one
process would (a greedy judge gives the same verdicts either way); a resumed run judges as the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import nullcontext

import torch

from lathe.batch import Batch
from lathe.device import synchronize
from lathe.dtypes import rollout_dtype, short_name
from lathe.generation import SamplingParams
from lathe.generation.stop import decode_texts
from lathe.models import UnsupportedArchitecture, load_lathe_model
from lathe.models.hf import import_external_libs, load_tokenizer
from lathe.reward.judge import VerdictSpec, parse_verdict, question_of, render_prompt
from lathe.rollout.build import build_engine, eos_token_ids
from lathe.train.offload import HostWeights

log = logging.getLogger("lathe")
KEY = "reward_model.model.path"
JUDGE_KEYS = ("judge_scores", "judge_parsed", "judge_judged", "judge_prompt_tokens", "judge_response_tokens")


def verdict_spec(judge_cfg) -> VerdictSpec:
    low, high = judge_cfg.score_range
    return VerdictSpec(parser=judge_cfg.parser, low=float(low), high=float(high), labels=dict(judge_cfg.labels))


def judge_sampling(rollout_cfg, seed: int) -> SamplingParams:
    """The judge's sampling parameters (`reward_model.rollout`): one verdict of at most `response_length` tokens."""
    return SamplingParams(n=1, temperature=rollout_cfg.temperature, top_k=rollout_cfg.top_k, top_p=rollout_cfg.top_p,
                          do_sample=rollout_cfg.do_sample, max_tokens=rollout_cfg.response_length, seed=seed)


def load_judge_model(path: str, dtype: torch.dtype, device: torch.device):
    """lathe's decoder with the judge's weights (the engine runs nothing else)."""
    try:
        return load_lathe_model(path, dtype, device=device)
    except UnsupportedArchitecture as e:
        raise ValueError(f"{KEY}={path} with reward_model.judge.enable=true: the judge runs on lathe's engine, which "
                         f"runs lathe's decoder only ({e}). Fix: use a causal LM lathe implements (Llama, Qwen2/2.5, "
                         "Qwen3, Qwen3-MoE) as the judge") from None


class JudgeWorker:
    def __init__(self, cfg, policy_tokenizer, *, device: torch.device):
        """`cfg`: the whole config (`reward_model.*` is read); `policy_tokenizer`: the tokenizer of the responses."""
        rm = cfg.reward_model
        self.judge_cfg = rm.judge
        self.rollout_cfg = rm.rollout
        self.device, self.policy_tokenizer = torch.device(device), policy_tokenizer
        self.spec = verdict_spec(rm.judge)
        path = rm.model.path
        import_external_libs({"reward_model.model.external_lib": rm.model.external_lib})
        self.tokenizer = load_tokenizer(path, trust_remote_code=rm.model.trust_remote_code)
        if rm.judge.apply_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{KEY}={path}: the judge's tokenizer has no chat template, and "
                             "reward_model.judge.apply_chat_template=true sends the judge prompt as a chat message. "
                             "Fix: use a judge with a chat template, or set reward_model.judge.apply_chat_template="
                             "false (the prompt as raw text)")
        dtype = rollout_dtype(rm.rollout.dtype, self.device)
        model = load_judge_model(path, dtype, self.device).requires_grad_(False)
        rows = model.lm_head.weight.shape[0]
        if len(self.tokenizer) > rows:
            raise ValueError(f"{KEY}={path}: the judge's tokenizer has {len(self.tokenizer)} tokens but its model "
                             f"scores {rows}; its prompts would hold ids the model cannot read. Fix: save the judge "
                             "with its own tokenizer (the one it was trained with)")
        self.offload = rm.model.fsdp_config.param_offload and self.device.type == "cuda"
        eager = dict(compile_model=False, fuse_projections=False) if self.offload else {}
        self.engine = build_engine(rm.rollout, model, eos_token_ids(self.tokenizer, model), engine_model=model,
                                   **eager)
        self.free_cache = rm.rollout.free_cache_engine and self.device.type == "cuda"
        if self.free_cache:
            self.engine.sleep()
        self.host = HostWeights(model, self.device) if self.offload else None
        log.info("judge: %s (%s parameters, %s) on %s, %s verdicts read as %s%s", path,
                 f"{sum(p.numel() for p in model.parameters()):,}", short_name(dtype), self.device,
                 "greedy" if judge_sampling(rm.rollout, 0).greedy else "sampled", rm.judge.parser,
                 ", weights in host memory between calls" if self.offload else "")

    # -- prompts ---------------------------------------------------------------------------------------
    def judge_texts(self, batch: Batch) -> list[str]:
        """Each row's judge prompt as text (before the chat template)."""
        lengths = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(-1).tolist()
        responses = decode_texts(self.policy_tokenizer, [ids[:n] for ids, n in
                                                         zip(batch["responses"].tolist(), lengths)])
        raw = batch["raw_prompt"] if "raw_prompt" in batch else [None] * len(batch)
        truths = batch["ground_truth"] if "ground_truth" in batch else [None] * len(batch)
        return [render_prompt(self.judge_cfg.prompt_template, question=question_of(q), response=r, ground_truth=gt)
                for q, r, gt in zip(raw, responses, truths)]

    def judge_prompt_ids(self, text: str) -> list[int]:
        """The judge's token ids of one prompt text."""
        if self.judge_cfg.apply_chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # -- judging ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        """Per row: `judge_scores` (the verdict's score, or the default), `judge_parsed` (1 when it parsed),
        `judge_judged` (0 when the prompt was too long to judge), `judge_prompt_tokens`, `judge_response_tokens`;
        and `judge_texts` (the judge's answers) as a column."""
        if "multi_modal_inputs" in batch and any(x is not None for x in batch["multi_modal_inputs"]):
            raise NotImplementedError("reward_model.judge.enable=true with image prompts: lathe's judge reads text "
                                      "only. Fix: train on text prompts, or set reward_model.judge.enable=false")
        prompts = [self.judge_prompt_ids(t) for t in self.judge_texts(batch)]
        judged = [i for i, p in enumerate(prompts) if len(p) <= self.rollout_cfg.prompt_length]
        answers = self._generate([prompts[i] for i in judged])
        n = len(prompts)
        texts, out_tokens = [""] * n, [0] * n
        for i, ids in zip(judged, answers):
            texts[i], out_tokens[i] = self.tokenizer.decode(ids, skip_special_tokens=True), len(ids)
        verdicts: list[float | None] = [None] * n
        for i in judged:
            verdicts[i] = parse_verdict(texts[i], self.spec)
        failed = [i for i in judged if verdicts[i] is None]
        if failed:
            log.info("judge: %d of %d verdicts did not parse (scored %s); the first: %r", len(failed), len(judged),
                     self.judge_cfg.default_score, texts[failed[0]][:500])
        default = self.judge_cfg.default_score
        mark = torch.zeros(n)
        mark[judged] = 1.0
        return Batch({"judge_scores": torch.tensor([default if v is None else v for v in verdicts],
                                                   dtype=torch.float32),
                      "judge_parsed": torch.tensor([float(v is not None) for v in verdicts]),
                      "judge_judged": mark,
                      "judge_prompt_tokens": torch.tensor([float(len(p)) for p in prompts]),
                      "judge_response_tokens": torch.tensor([float(x) for x in out_tokens])},
                     {"judge_texts": texts})

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """The engine's answers to `prompts` (token ids without the prompt), the judge woken for the call."""
        if not prompts:
            return []
        digest = hashlib.sha256(f"{self.rollout_cfg.seed}/{prompts}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 2
        with self.host.on_device() if self.host is not None else nullcontext():
            if self.free_cache:
                self.engine.wake_up()
            try:
                out = self.engine.generate(prompts, judge_sampling(self.rollout_cfg, seed))
            finally:
                if self.free_cache:
                    self.engine.sleep()
        return out.token_ids


def judge_metrics(out: Batch, seconds: float) -> dict[str, float]:
    """The judge's metrics of one call: mean score, parse failures, prompts not judged, tokens, seconds."""
    judged = out["judge_judged"]
    n_judged = float(judged.sum())
    return {"reward_judge/score/mean": out["judge_scores"].mean().item(),
            "reward_judge/parse_failure_rate": (float(((1 - out["judge_parsed"]) * judged).sum()) / n_judged
                                                if n_judged else 0.0),
            "reward_judge/prompt_overflow_rate": 1.0 - n_judged / max(len(judged), 1),
            "reward_judge/prompt_tokens": float(out["judge_prompt_tokens"].sum()),
            "reward_judge/response_tokens": float(out["judge_response_tokens"].sum()),
            "timing_s/reward_judge": seconds}


def timed_judge(judge, batch: Batch, device: torch.device) -> tuple[Batch, dict[str, float]]:
    """`judge.compute_rm_score(batch)` (a worker or its Ray group) and its metrics."""
    synchronize(device)
    start = time.perf_counter()
    out = judge.compute_rm_score(batch)
    synchronize(device)
    return out, judge_metrics(out, time.perf_counter() - start)
