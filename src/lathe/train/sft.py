"""Supervised fine-tuning: teacher-forced cross-entropy on the trained tokens only.

`sft_loss` and `sft_batch` are what `lathe sft`'s worker (`lathe.workers.sft.SFTWorker`) trains on;
`supervised_fit` is the built-in default's warm start (a random model cannot find the answer format by RL alone
within minutes).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from lathe.batch import Batch
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train.logprob import response_log_probs


def sft_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
              loss_masks: list[list[int]] | None = None) -> Batch:
    """The rollout batch layout, built from given responses instead of sampled ones; `response_mask` is
    `loss_masks` (1 = trained) when given, else every response token."""
    out = RolloutOutput(response_ids, [[0.0] * len(r) for r in response_ids], ["stop"] * len(response_ids))
    batch = to_batch(prompt_ids, out, pad_id, n=1)
    if loss_masks is not None:
        mask = torch.zeros_like(batch["response_mask"])
        for i, m in enumerate(loss_masks):
            mask[i, :len(m)] = torch.tensor(m, dtype=mask.dtype)
        batch["response_mask"] = mask
    return batch


def sft_loss(model, batch: Batch) -> torch.Tensor:
    """Mean negative log-likelihood over all response tokens of the batch."""
    log_probs, _ = response_log_probs(model, batch)
    mask = batch["response_mask"].to(log_probs.dtype)
    return -(log_probs * mask).sum() / mask.sum().clamp(min=1)


def supervised_fit(model, examples: list[tuple[list[int], ...]], *, steps: int, lr: float, batch_size: int,
                   pad_id: int, seed: int, device: torch.device, grad_clip: float = 1.0,
                   on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`steps` AdamW steps on (prompt_ids, response_ids) pairs, or (prompt_ids, response_ids, loss_mask) triples
    (1 = trained; a pair trains every response token), sampled with a private RNG; returns the losses.
    `on_step(steps done, loss)` is called after each (progress).

    Uses its own random stream so the caller's RNG state (and thus RL sampling) is untouched.
    """
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        chunk = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        masks = [ex[2] if len(ex) > 2 else [1] * len(ex[1]) for ex in chunk]
        batch = sft_batch([ex[0] for ex in chunk], [ex[1] for ex in chunk], pad_id, loss_masks=masks).to(device)
        loss = sft_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(len(losses), losses[-1])
    return losses
