"""Per-token log-probs (and entropy) of response tokens under a causal LM.

The response occupies the last R positions of `input_ids`; the logits that predict it are the R
positions before. Logits are divided by the sampling temperature first, exactly as the rollout did.

Two implementations behind one call:
- a transformers model: one padded forward and full (B, R, V) float32 logits;
- lathe's decoder (`LatheCausalLM`): `lathe.models.logprob.chunked_log_probs`, which never holds the
  (tokens x vocab) logits. With `remove_padding=True` (verl's `use_remove_padding`) the forward runs
  packed over the real tokens (`forward_packed`) and only real response tokens reach `lm_head`
  (padding positions hold 0); else a padded forward, every (B, R) position computed as transformers
  does. Both give the same numbers at real tokens, so the same masked losses and gradients.

A lathe model compiled by `lathe.models.compile.compile_decoder` (the actor with `use_torch_compile`) also
runs the chunked log-prob/entropy math compiled, with the same backend.
"""

from __future__ import annotations

import torch

from lathe.batch import Batch
from lathe.models.decoder import LatheCausalLM
from lathe.models.logprob import chunked_log_probs
from lathe.models.logprob import response_log_probs as padded_log_probs
from lathe.models.packing import pack_padded
from lathe.train import parallel
from lathe.train.micro import in_batch_order, micro_batches

LOGPROB_CHUNK_SIZE = 1024   # tokens per lm_head chunk: peak extra memory ~ chunk x vocab x 4 bytes (x3 in backward)


def response_positions(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid (B, R) bool, source (N,)): the real response tokens, and for each, the flat index into the
    (B * L) padded batch of the position whose hidden state predicts it (the position before it)."""
    B, L = batch["input_ids"].shape
    R = batch["responses"].shape[1]
    valid = batch["attention_mask"][:, L - R:].bool()
    rows = torch.arange(B, device=valid.device).unsqueeze(1) * L
    cols = torch.arange(L - R - 1, L - 1, device=valid.device).unsqueeze(0)
    return valid, (rows + cols)[valid]


def response_hidden(model, batch: Batch, *, remove_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), valid (B, R)): final hidden states predicting the N real response tokens of a lathe model
    (`LatheCausalLM` or `LatheValueModel`), from a packed forward when `remove_padding`, else a padded one."""
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    valid, source = response_positions(batch)
    if not remove_padding:
        hidden = model.hidden_padded(ids, mask, pos)
        return hidden.reshape(-1, hidden.shape[-1])[source], valid
    packed = pack_padded(ids, mask, pos)
    hidden = model.hidden_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
    where = torch.full((ids.numel(),), -1, dtype=torch.long, device=ids.device)
    where[packed.indices] = torch.arange(len(packed.indices), device=ids.device)
    index = where[source]
    if bool((index < 0).any()):
        raise ValueError("a response token follows a padding position (attention_mask 0): the batch must be a "
                         "left-padded prompt followed by a right-padded response, as rollout.base.to_batch builds it")
    return hidden[index], valid


def scatter_response(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) values of the real response tokens -> (B, R), 0 at padding. Differentiable."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


def response_log_probs(model, batch: Batch, *, temperature: float = 1.0, calculate_entropy: bool = False,
                       remove_padding: bool = False, chunk_size: int = LOGPROB_CHUNK_SIZE
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs (B, R), entropy (B, R) or None) float32 of `batch["responses"]`.

    `remove_padding` and `chunk_size` apply to lathe's decoder; a transformers model always runs padded.
    """
    if isinstance(model, LatheCausalLM) and not remove_padding:
        return padded_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                batch["responses"], temperature=temperature, chunk_size=chunk_size,
                                calculate_entropy=calculate_entropy)
    if isinstance(model, LatheCausalLM):
        hidden, valid = response_hidden(model, batch, remove_padding=True)
        logp, entropy = chunked_log_probs(hidden, model.lm_head.weight, batch["responses"][valid],
                                          temperature=temperature, chunk_size=chunk_size,
                                          calculate_entropy=calculate_entropy, compile_backend=model.compile_backend)
        return scatter_response(logp, valid), (scatter_response(entropy, valid) if calculate_entropy else None)
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
                      calculate_entropy: bool = False, remove_padding: bool = False,
                      max_tokens: int | None = None, max_tokens_key: str = "log_prob_max_token_len_per_gpu"
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` over micro-batches (`micro_batch_size` sequences, or packed by `max_tokens`: see
    `lathe.train.micro`), in eval mode, without gradients; rows in the batch's order."""
    was_training = model.training
    model.eval()
    try:
        parts = [(response_log_probs(model, mb, temperature=temperature, calculate_entropy=calculate_entropy,
                                     remove_padding=remove_padding), rows)
                 for mb, rows in micro_batches(batch, size=micro_batch_size, max_tokens=max_tokens,
                                               key=max_tokens_key)]
    finally:
        model.train(was_training)
        parallel.reshard(model)
    log_probs = in_batch_order([(p[0], rows) for p, rows in parts])
    entropy = in_batch_order([(p[1], rows) for p, rows in parts]) if calculate_entropy else None
    return log_probs, entropy
