"""Validation: generate on the validation set with `rollout.val_kwargs`, score, report per data source.

Runs on a private RNG stream, so validating (or not) never changes the training run's samples.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from lathe.loop.dump import generation_rows, report_validation, wants_validation_rows
from lathe.loop.setup import Trainer, prompt_batch
from lathe.loop.steps import compute_reward
from lathe.track import phase


def validate(t: Trainer) -> dict[str, float]:
    """verl's `val-core/<data_source>/reward/mean@<n>` for each data source of the validation set.

    The samples also go to `trainer.validation_data_dir` and, `trainer.log_val_generations` of them, to the
    loggers (see `lathe.loop.dump`).
    """
    ds = t.val_dataset
    batch_size = t.cfg.data.val_batch_size or len(ds)
    scores: dict[str, list[float]] = defaultdict(list)
    samples: list[dict] = []
    with torch.random.fork_rng(devices=[]), phase(f"validating on {len(ds)} prompts",
                                                  done=f"validated on {len(ds)} prompts"):
        torch.manual_seed(t.cfg.trainer.seed)
        for start in range(0, len(ds), batch_size):
            rows = [ds[i] for i in range(start, min(start + batch_size, len(ds)))]
            batch = t.worker.generate_sequences(prompt_batch(rows, step=-1), t.val_sampling)
            result, _ = compute_reward(batch, t.tokenizer, t.reward)
            for source, score in zip(batch["data_source"], result["seq_scores"].tolist()):
                scores[source].append(score)
            if wants_validation_rows(t.cfg.trainer):
                samples += generation_rows(batch.update(result), t.tokenizer, t.global_step)
    report_validation(t, samples)
    n = t.val_sampling.n
    return {f"val-core/{source}/reward/mean@{n}": float(np.mean(v)) for source, v in scores.items()}
