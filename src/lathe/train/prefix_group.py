"""Prefix-grouped forward (verl's `actor.use_prefix_grouper`): each prompt runs once for all its responses.

A GRPO batch holds each prompt `rollout.n` times. Here the rows of a (micro-)batch that share a prompt (the same
real prompt tokens and positions, whatever their left padding) become one packed run of segments,

    [prompt | response_1 | response_2 | ... | response_m]

where the prompt's segment attends causally to itself and each response's segment to the prompt, then causally to
itself (`lathe.models.attention.GroupedAttention`: its keys gathered from the stream, its queries the last of them),
with every token at the position it had in its own row. Each response token then gets exactly the hidden state it
gets in its own row (the same attention inputs, summed in a different order), so log-probs, entropies and gradients
equal the ungrouped forward's up to rounding, while the prompt's tokens are computed once per group instead of once
per response. The first token of every response is predicted from the prompt's last hidden state, which the group
shares. On flash attention the whole stream is one varlen call (each response's keys are its prompt's K/V, gathered,
then its own: memory linear in the stream); elsewhere SDPA per segment.

lathe's decoder only (`LatheCausalLM.hidden_grouped`); a response token may not follow padding (the rollout's
left-padded prompt, right-padded response layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.batch import Batch
from lathe.models.attention import GroupedAttention

BAD_LAYOUT = ("use_prefix_grouper: a response token follows a padding position (attention_mask 0): the batch must "
              "be a left-padded prompt followed by a right-padded response, as rollout.base.to_batch builds it")


@dataclass
class GroupedLayout:
    """The grouped rows of a batch as one packed stream of T tokens, and where each real response token's predictor
    sits."""
    input_ids: torch.Tensor      # (T,)
    position_ids: torch.Tensor   # (T,)
    cu_q: torch.Tensor           # (S+1,) int32: the segments (each group's prompt, then its responses)
    cu_k: torch.Tensor           # (S+1,) int32: each segment's keys in `kv_index`
    kv_index: torch.Tensor       # (Tk,) int64: the stream rows a segment attends to (its prompt's, then its own)
    max_q: int
    max_k: int
    source: torch.Tensor         # (N,) index into the stream of the hidden state that predicts each response token
    valid: torch.Tensor          # (B, R) bool: the real response tokens, in the order of `source`

    def attention(self, backend: str) -> GroupedAttention:
        return GroupedAttention(self.cu_q, self.cu_k, self.kv_index, self.max_q, self.max_k, backend)


def grouped_layout(batch: Batch) -> GroupedLayout:
    """Group the batch's rows by prompt (see the module docstring); built on the host, moved to the batch's device."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = batch["attention_mask"].bool().cpu()
    ids, pos = batch["input_ids"].cpu(), batch["position_ids"].cpu()
    valid = mask[:, P:]
    lengths = valid.sum(-1)
    if bool((valid != (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(-1))).any()):
        raise ValueError(BAD_LAYOUT)
    groups: dict[tuple, list[int]] = {}
    for row in range(ids.shape[0]):
        key = (tuple(ids[row, :P][mask[row, :P]].tolist()), tuple(pos[row, :P][mask[row, :P]].tolist()))
        groups.setdefault(key, []).append(row)
    tokens, positions, cu_q, cu_k, kv_index = [], [], [0], [0], []
    predictor = {}                  # row -> stream index of the hidden state predicting its first response token
    start_of = {}                   # row -> stream index of its response's first token
    for (prompt, prompt_pos), rows in groups.items():
        if not prompt:
            raise ValueError("use_prefix_grouper: a row has an empty prompt; a response needs a prompt token before it")
        at = len(tokens)
        prompt_rows = list(range(at, at + len(prompt)))
        tokens += prompt
        positions += prompt_pos
        cu_q.append(len(tokens))
        kv_index += prompt_rows
        cu_k.append(len(kv_index))
        for row in rows:
            n = int(lengths[row])
            predictor[row], start_of[row] = prompt_rows[-1], len(tokens)
            if n == 0:
                continue
            kv_index += prompt_rows + list(range(len(tokens), len(tokens) + n))
            tokens += ids[row, P:P + n].tolist()
            positions += pos[row, P:P + n].tolist()
            cu_q.append(len(tokens))
            cu_k.append(len(kv_index))
    source = []
    for row in range(ids.shape[0]):
        n = int(lengths[row])
        source += [predictor[row]] + list(range(start_of[row], start_of[row] + n - 1)) if n else []
    seg_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    seg_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    device = batch["input_ids"].device

    def on_device(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)
    return GroupedLayout(on_device(tokens, ids.dtype), on_device(positions, pos.dtype), on_device(cu_q, torch.int32),
                         on_device(cu_k, torch.int32), on_device(kv_index, torch.long), max(seg_q), max(seg_k),
                         on_device(source, torch.long), valid.to(device))


def grouped_hidden(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), valid (B, R)): the final hidden states predicting the N real response tokens, from one
    prefix-grouped forward of lathe's decoder (`LatheCausalLM.hidden_grouped`)."""
    layout = grouped_layout(batch)
    hidden = model.hidden_grouped(layout.input_ids, layout.position_ids, layout.attention(model.packed_backend()))
    return hidden[layout.source], layout.valid
