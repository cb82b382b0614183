"""The named steps the driver sequences between worker calls: reward, advantage, PF-PPO's redraw, data metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch

from lathe.algo import (ROLLOUT_CORRECTION_KEYS, apply_kl_penalty, compute_rollout_correction, get_adv_estimator,
                        overlong_reward_penalty, pf_ppo_resample)
from lathe.batch import Batch
from lathe.data.dataset import REWARD_SOURCE
from lathe.generation.stop import decode_texts
from lathe.reward import ScoreResult
from lathe.rollout.agent import AGENT_SCORE
from lathe.reward.judge import combine_scores
from lathe.seeding import derive_seed


def response_attention(batch: Batch) -> torch.Tensor:
    """(B, R) 1 on every real response token: the model's and, in multi-turn rollouts, the tool answers between its
    turns (`response_mask`, the loss mask, covers only the model's)."""
    return batch["attention_mask"][:, -batch["responses"].shape[1]:]


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    """Response text of each row: valid tokens only (tool answers included), special tokens dropped (verl's naive
    manager)."""
    lengths = response_attention(batch).sum(-1).tolist()
    return decode_texts(tokenizer, [ids[:n] for ids, n in zip(batch["responses"].tolist(), lengths)])


def last_model_token(mask: torch.Tensor) -> torch.Tensor:
    """(B,) the position of each row's last loss-mask token (0 for an empty row): where its score sits."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).max(-1).values


def compute_reward(batch: Batch, tokenizer, reward_manager, *, overlong=None, max_response_length: int | None = None,
                   rm_scores: torch.Tensor | None = None,
                   combine: tuple[str, float] | None = None) -> tuple[Batch, dict[str, float]]:
    """Score each response; the score sits on its last valid token (`token_level_scores`, (B, R)): the model's last
    token of a multi-turn trajectory (`response_mask` is 0 on tool answers).

    `seq_scores` keeps the scorer's own numbers; `token_level_scores` adds DAPO's overlong penalty when
    `overlong` (verl's `reward_model.overlong_buffer`) is enabled. `reward_extra_info` holds each scorer's
    extra numbers per sample (their means are the `reward_extra/*` metrics). `rm_scores` (B,): a learned reward
    model's scores, which are then the scores (verl's reward managers return `rm_scores` when the batch has them;
    the rule scorers are not called). `combine` (a generative judge's `reward_model.judge.{combine, weight}`):
    with `sum` or `product` the rule scorers run too and each score is the rule's joined with `rm_scores`
    (`lathe.reward.judge.combine_scores`; the rule's extras, such as `acc`, are kept).
    """
    texts = decode_responses(batch, tokenizer)
    mode, weight = combine or ("judge", 1.0)
    metrics: dict[str, float] = {}
    # a custom agent loop's own scores (its AgentLoopOutput.reward_score): those samples skip the reward function
    given = list(batch[AGENT_SCORE]) if AGENT_SCORE in batch else [None] * len(texts)
    if rm_scores is None or mode != "judge":
        sources = batch[REWARD_SOURCE] if REWARD_SOURCE in batch else batch["data_source"]   # data.reward_fn_key
        items = [{"data_source": ds, "solution_str": text, "ground_truth": gt, "extra_info": extra}
                 for ds, text, gt, extra in zip(sources, texts, batch["ground_truth"], batch["extra_info"])]
        todo = [i for i, x in enumerate(given) if x is None]
        scored = iter(reward_manager.score([items[i] for i in todo]) if todo else [])
        results = [ScoreResult(float(x)) if x is not None else next(scored) for x in given]
        metrics.update(reward_manager.metrics())
        if rm_scores is not None:
            joined = combine_scores([r.score for r in results], rm_scores.tolist(), mode, weight)
            results = [replace(r, score=float(x)) for r, x in zip(results, joined)]
    else:
        results = [ScoreResult(float(x if g is None else g)) for x, g in zip(rm_scores.tolist(), given)]
    mask = batch["response_mask"]
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    shaped = scores
    if overlong is not None and overlong.enable:
        penalty = overlong_reward_penalty(response_attention(batch).sum(-1), max_response_length, overlong.len,
                                          overlong.penalty_factor)
        shaped = scores + penalty
        if overlong.log:
            metrics["reward_extra/overlong_reward/mean"] = penalty.mean().item()
            metrics["reward_extra/overlong/mean"] = (penalty < 0).float().mean().item()
    token_level = torch.zeros(mask.shape, dtype=torch.float32)
    token_level[torch.arange(len(scores)), last_model_token(mask)] = shaped
    metrics.update(reward_extra_means([r.extra for r in results]))
    out = Batch({"token_level_scores": token_level, "seq_scores": scores},
                {"response_text": texts, "reward_extra_info": [dict(r.extra) for r in results]})
    if results and all("acc" in r.extra for r in results):
        out["acc"] = torch.tensor([r.extra["acc"] for r in results], dtype=torch.float32)
    return out, metrics


def reward_extra_means(extras: list[dict]) -> dict[str, float]:
    """`reward_extra/<key>/mean` over the samples' scorer extras (each key over the samples that have it)."""
    values: dict[str, list[float]] = defaultdict(list)
    for extra in extras:
        for k, v in extra.items():
            values[k].append(v)
    return {f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in values.items()}


def apply_rollout_correction(batch: Batch, rc_cfg) -> tuple[Batch, dict[str, float]]:
    """IS weights / rejection masks for the rollout-vs-trainer mismatch (`algorithm.rollout_correction`)."""
    weights, mask, metrics = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], **rollout_correction_kwargs(rc_cfg))
    out = Batch({"response_mask": mask.to(batch["response_mask"].dtype)})
    if weights is not None:
        out["rollout_is_weights"] = weights
    return out, {k: float(v) for k, v in metrics.items()}


def rollout_correction_kwargs(rc_cfg) -> dict:
    """The `algorithm.rollout_correction.*` keys the algorithm functions take."""
    return {k: getattr(rc_cfg, k) for k in ROLLOUT_CORRECTION_KEYS}


def rollout_correction_enabled(rc_cfg) -> bool:
    return rc_cfg.rollout_is is not None or rc_cfg.rollout_rs is not None


def compute_advantage(batch: Batch, algo_cfg, kl_ctrl=None) -> tuple[Batch, dict[str, float]]:
    """`token_level_rewards` (scores, minus the KL penalty when `use_kl_in_reward`), advantages and returns."""
    metrics: dict[str, float] = {}
    scores = batch["token_level_scores"]
    if algo_cfg.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_prob"],
                                               batch["response_mask"], kl_ctrl, algo_cfg.kl_penalty)
        metrics.update({k: float(v) for k, v in kl_metrics.items()})
    else:
        rewards = scores
    estimator = get_adv_estimator(algo_cfg.adv_estimator)
    gdpo = algo_cfg.adv_estimator == "gdpo"
    advantages, returns = estimator(
        token_level_rewards=rewards, response_mask=batch["response_mask"], index=batch["uid"],
        values=batch.tensors.get("values"), gamma=algo_cfg.gamma, lam=algo_cfg.lam,
        norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo,
        reward_baselines=batch.tensors.get("reward_baselines"),
        old_log_probs=batch.tensors.get("old_log_probs"), sum_pi_squared=batch.tensors.get("sum_pi_squared"),
        rollout_is_weights=batch.tensors.get("rollout_is_weights"),
        reward_components=reward_components(batch, algo_cfg.gdpo_reward_keys) if gdpo else None,
        reward_weights=algo_cfg.gdpo_reward_weights)
    return Batch({"token_level_rewards": rewards, "advantages": advantages, "returns": returns}), metrics


def resample_by_score(batch: Batch, algo_cfg, seed: int, step: int) -> tuple[Batch, dict[str, float]]:
    """PF-PPO (`algorithm.use_pf_ppo`, `lathe.algo.pf_ppo`): the batch the updates train on, its rows redrawn with
    replacement by their sequence scores (`token_level_scores` summed, as verl), every field along; the draw seeded
    by (`trainer.seed`, the step), so a resumed run redraws as the uninterrupted one. The caller's batch is left as
    it is. Metrics: `pf_ppo/distinct_rows` (rows drawn at least once), `pf_ppo/score_before/mean` (the mean score
    before the draw; `critic/score/*` then describe the redrawn batch, as in verl)."""
    pf = algo_cfg.pf_ppo
    scores = batch["token_level_scores"].sum(-1)
    generator = torch.Generator().manual_seed(derive_seed(seed, step, "pf_ppo"))
    rows = pf_ppo_resample(scores, pf.reweight_method, pf.weight_pow, generator=generator)
    return batch.select(rows), {"pf_ppo/distinct_rows": float(rows.unique().numel()),
                                "pf_ppo/score_before/mean": scores.float().mean().item()}


def reward_components(batch: Batch, keys: list[str] | None) -> torch.Tensor:
    """(B, K) float32: column k holds each response's `keys[k]` from its reward function's dict (`reward_extra_info`),
    GDPO's per-component scores (`algorithm.gdpo_reward_keys`). A response whose scoring failed (no extras at all:
    the reward manager counted it and scored it 0) scores 0 on every component; a key missing from a response that
    has extras is an error naming the key and the keys present. `score` is the score itself."""
    extras = list(batch["reward_extra_info"]) if "reward_extra_info" in batch else []
    present = sorted({k for extra in extras for k in extra})
    columns = []
    for key in keys or []:
        if key == "score" and key not in present:           # the dict's own score (verl keeps it with the extras)
            columns.append(batch["seq_scores"].tolist())
            continue
        lacking = [i for i, extra in enumerate(extras) if extra and key not in extra]
        if lacking or key not in present:
            raise ValueError(
                f"algorithm.gdpo_reward_keys names {key!r}, but the reward function's results "
                f"{'of ' + str(len(lacking)) + ' responses ' if lacking else ''}have no such key (keys present: "
                f"{', '.join(present) or 'none: it returned plain numbers'}). Fix: return a dict with {key!r} from "
                "the reward function (reward.custom_reward_function), or list only keys it returns.")
        columns.append([float(extra.get(key, 0.0)) for extra in extras])
    return torch.tensor(columns, dtype=torch.float32).t().reshape(len(batch), len(columns))


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: Batch, *, max_response_length: int) -> dict[str, float]:
    """verl's `critic/*`, `response_length/*` and `prompt_length/*` metrics of one step's batch."""
    mask = batch["response_mask"].bool()
    resp_len = response_attention(batch).sum(-1).float()
    prompt_len = (batch["attention_mask"].sum(-1) - resp_len).float()
    m: dict[str, float] = {}
    m.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    m.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    m.update(_stats("critic/advantages", batch["advantages"][mask]))
    m.update(_stats("critic/returns", batch["returns"][mask]))
    if "values" in batch:
        m.update(_stats("critic/values", batch["values"][mask]))
    m.update(_stats("response_length", resp_len))
    m["response_length/clip_ratio"] = (resp_len >= max_response_length).float().mean().item()
    m.update(_stats("prompt_length", prompt_len))
    if "num_turns" in batch:                     # a multi-turn rollout (verl's num_turns; lathe's tool counts)
        m.update(_stats("num_turns", torch.tensor([float(x) for x in batch["num_turns"]])))
        for key in ("tool_calls", "tool_errors", "tool_seconds"):
            m[f"agent/{key}/mean"] = float(np.mean([float(x) for x in batch[key]]))
        m["agent/tool_calls/total"] = float(sum(batch["tool_calls"]))
    return m


def compute_throughput_metrics(batch: Batch, step_seconds: float, num_devices: int = 1) -> dict[str, float]:
    tokens = int(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / max(step_seconds, 1e-9) / num_devices}
