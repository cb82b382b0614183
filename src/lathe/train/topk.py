"""Top-k log-probs at the response positions, for on-policy distillation's top-k forward KL (verl's
`distillation_loss.loss_mode=forward_kl_topk`).

The teacher gives, at each response position, its k most likely next tokens and their log-probs
(`batched_teacher_topk`, no gradient); the student's log-probs of those same tokens, with gradient, come from the
actor's training forward (`student_topk_log_probs`). Both read the final hidden states of the positions that predict
the response tokens (`lathe.train.logprob.response_hidden`: packed or padded, lathe's decoder or VL model) through the
output layer chunk by chunk, so at most `chunk_size x vocab` logits exist at once (the student's chunks are
recomputed in backward); a transformers model gives its full (B, R, V) logits. Padding positions hold 0 (log-probs)
and token 0 (ids). A student cut by tensor parallelism (its lm_head over the vocabulary) reads the given tokens and
its own top k from each rank's slice of the vocabulary (`lathe.train.vocab_parallel.vocab_parallel_topk_log_probs`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from lathe.batch import Batch
from lathe.models.decoder import LatheCausalLM
from lathe.models.vl import LatheVLForConditionalGeneration
from lathe.train import parallel
from lathe.train.logprob import LOGPROB_CHUNK_SIZE, response_hidden
from lathe.train.micro import in_batch_order, micro_batches
from lathe.train.vocab_parallel import vocab_parallel_topk_log_probs, vocab_sharded


def _lathe(model) -> bool:
    return isinstance(model, (LatheCausalLM, LatheVLForConditionalGeneration))


def _full_log_softmax(model, batch: Batch, temperature: float) -> torch.Tensor:
    """(B, R, V) float32 log-softmax at the response positions of a transformers model."""
    R = batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    return torch.log_softmax(out.logits[:, -R - 1:-1].float() / temperature, dim=-1)


def _chunk_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)


def teacher_topk(model, batch: Batch, *, k: int, remove_padding: bool = False, vocab: int | None = None,
                 chunk_size: int = LOGPROB_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, R, k) float32, token ids (B, R, k) long) of the k most likely tokens at each response position,
    at temperature 1 (the teacher's raw distribution). `vocab`: the k are chosen among the first `vocab` ids only
    (the student's tokens: a teacher's output layer may have more rows, e.g. Qwen2.5-7B's 152064 beside a 1.5B's
    151936, and an id past the student's is one it cannot score); their log-probs stay the teacher's own."""
    B, R = batch["responses"].shape
    if not _lathe(model):
        valid = batch["attention_mask"][:, -R:].bool()
        values, ids = _full_log_softmax(model, batch, 1.0)[..., :vocab].topk(k, dim=-1)
        return values * valid.unsqueeze(-1), ids * valid.unsqueeze(-1)
    hidden, valid = response_hidden(model, batch, remove_padding=remove_padding)
    parts = [_chunk_log_softmax(h, model.lm_head.weight, 1.0)[:, :vocab].topk(k, dim=-1)
             for h in hidden.split(chunk_size)]
    values = torch.zeros(B, R, k, dtype=torch.float32, device=hidden.device)
    ids = torch.zeros(B, R, k, dtype=torch.long, device=hidden.device)
    if parts:
        values[valid] = torch.cat([p.values for p in parts])
        ids[valid] = torch.cat([p.indices for p in parts])
    return values, ids


@torch.no_grad()
def batched_teacher_topk(model, batch: Batch, *, k: int, micro_batch_size: int, remove_padding: bool = False,
                         vocab: int | None = None, max_tokens: int | None = None,
                         max_tokens_key: str = "log_prob_max_token_len_per_gpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`teacher_topk` over micro-batches (as `lathe.train.logprob.batched_log_probs` cuts them), in eval mode; rows in
    the batch's order."""
    was_training = model.training
    model.eval()
    try:
        parts = [(teacher_topk(model, mb, k=k, remove_padding=remove_padding, vocab=vocab), rows)
                 for mb, rows in micro_batches(batch, size=micro_batch_size, max_tokens=max_tokens, key=max_tokens_key)]
    finally:
        model.train(was_training)
        parallel.reshard(model)
    return (in_batch_order([(p[0], rows) for p, rows in parts]), in_batch_order([(p[1], rows) for p, rows in parts]))


def student_topk_log_probs(model, batch: Batch, ids: torch.Tensor, *, temperature: float = 1.0,
                           remove_padding: bool = False, chunk_size: int = LOGPROB_CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (B, R, k) of tokens `ids` (B, R, k) under the student, with gradient; the student's own top-k ids
    (B, R, k), for verl's overlap metrics). Logits divided by `temperature` as in the actor's log-probs."""
    B, R, k = ids.shape
    if not _lathe(model):
        logp = _full_log_softmax(model, batch, temperature)
        return logp.gather(-1, ids), logp.detach().topk(k, dim=-1).indices
    hidden, valid = response_hidden(model, batch, remove_padding=remove_padding)
    wanted = ids.to(hidden.device)[valid]
    weight = model.lm_head.weight

    def gather(h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if vocab_sharded(weight):       # tensor parallelism: this rank's rows of the lm_head
            return vocab_parallel_topk_log_probs(h, weight.to_local(), idx, weight.device_mesh.get_group(),
                                                 vocab_size=weight.shape[0], temperature=temperature)
        logp = _chunk_log_softmax(h, weight, temperature)
        return logp.gather(-1, idx), logp.detach().topk(k, dim=-1).indices

    parts = [checkpoint(gather, h, idx, use_reentrant=False)
             for h, idx in zip(hidden.split(chunk_size), wanted.split(chunk_size))]
    values = hidden.new_zeros(B, R, k, dtype=torch.float32)
    own = torch.zeros(B, R, k, dtype=torch.long, device=hidden.device)
    if parts:
        values = values.index_put((valid,), torch.cat([p[0] for p in parts]))
        own[valid] = torch.cat([p[1] for p in parts])
    return values, own
