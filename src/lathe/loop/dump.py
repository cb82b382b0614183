"""Samples written out for people to read (verl's keys and file layout).

* ``trainer.rollout_data_dir``: each training step's samples, ``<dir>/<global_step>.jsonl``;
* ``trainer.validation_data_dir``: each validation's samples, ``<dir>/<global_step>.jsonl``;
* ``trainer.log_val_generations``: that many validation samples (input, output, score) sent to the loggers,
  chosen as verl does (sorted by input, shuffled with seed 42, the first N) so runs log the same prompts.

One JSON line per sample: ``input`` (the templated prompt), ``output`` (the response), ``gts`` (ground
truth), ``score`` (the reward, after DAPO's overlong shaping when on), ``step``, and every reward extra
(e.g. ``acc``) that all samples have, and ``uid`` (the prompt's group) when the batch has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lathe.batch import Batch

VERL_SAMPLE_SEED = 42


def generation_rows(batch: Batch, tokenizer, step: int) -> list[dict[str, Any]]:
    """One row per sample of a scored batch (needs prompt_ids, response_text, ground_truth, token_level_scores)."""
    inputs = tokenizer.batch_decode([list(ids) for ids in batch["prompt_ids"]], skip_special_tokens=True)
    scores = batch["token_level_scores"].sum(-1).tolist()
    extras = list(batch["reward_extra_info"]) if "reward_extra_info" in batch else [{} for _ in scores]
    shared = [k for k in (extras[0] if extras else {}) if all(k in e for e in extras)]
    rows = [{"input": inp, "output": out, "gts": gt, "score": score, "step": step, **{k: extra[k] for k in shared}}
            for inp, out, gt, score, extra in zip(inputs, batch["response_text"], batch["ground_truth"], scores, extras)]
    if "uid" in batch:                  # the prompt's group (fully-async runs: its issue index, `p<index>`)
        for row, uid in zip(rows, batch["uid"]):
            row["uid"] = uid
    return rows


def write_rows(rows: list[dict[str, Any]], directory: str, step: int) -> Path:
    """``<directory>/<step>.jsonl`` (the directory is created; a rerun of a step overwrites its file)."""
    path = Path(directory).expanduser() / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=_plain) + "\n")
    return path


def dump_rollouts(t, batch: Batch) -> None:
    """``trainer.rollout_data_dir``: the step's samples as jsonl (nothing when unset)."""
    directory = t.cfg.trainer.rollout_data_dir
    if directory:
        write_rows(generation_rows(batch, t.tokenizer, t.global_step), directory, t.global_step)


def wants_validation_rows(trainer_cfg) -> bool:
    return bool(trainer_cfg.validation_data_dir) or trainer_cfg.log_val_generations > 0


def report_validation(t, rows: list[dict[str, Any]]) -> None:
    """``trainer.validation_data_dir`` file and ``trainer.log_val_generations`` samples of one validation."""
    tr = t.cfg.trainer
    if tr.validation_data_dir:
        write_rows([{**row, "reward": row["score"]} for row in rows], tr.validation_data_dir, t.global_step)
    if tr.log_val_generations > 0:
        samples = [(row["input"], row["output"], row["score"]) for row in rows]
        t.tracker.log_generations(pick_samples(samples, tr.log_val_generations), t.global_step)


def pick_samples(samples: list[tuple[str, str, float]], n: int) -> list[tuple[str, str, float]]:
    """verl's choice: sort by input, shuffle with a fixed seed, keep the first ``n``."""
    ordered = sorted(samples, key=lambda s: s[0])
    np.random.RandomState(VERL_SAMPLE_SEED).shuffle(ordered)
    return ordered[:n]


def _plain(value: Any) -> Any:
    """JSON for numpy scalars/arrays and tensors in ground truths or reward extras."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
