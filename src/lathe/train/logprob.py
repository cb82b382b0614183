"""Per-token log-probs (and entropy) of response tokens under a causal LM.

The response occupies the last R positions of `input_ids`; the logits that predict it are the R
positions before. Logits are divided by the sampling temperature first, exactly as the rollout did.
"""

from __future__ import annotations

import torch

from lathe.batch import Batch


def response_log_probs(model, batch: Batch, *, temperature: float = 1.0,
                       calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs (B, R), entropy (B, R) or None) of `batch["responses"]`."""
    responses = batch["responses"]
    R = responses.shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, -R - 1:-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if calculate_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy


@torch.no_grad()
def batched_log_probs(model, batch: Batch, *, micro_batch_size: int, temperature: float = 1.0,
                      calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` over micro-batches, in eval mode, without gradients."""
    was_training = model.training
    model.eval()
    try:
        parts = [response_log_probs(model, mb, temperature=temperature, calculate_entropy=calculate_entropy)
                 for mb in batch.split(micro_batch_size)]
    finally:
        model.train(was_training)
    log_probs = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if calculate_entropy else None
    return log_probs, entropy
