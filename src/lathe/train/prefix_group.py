"""Prefix-grouped forward (verl's `actor.use_prefix_grouper`): each prompt runs once for all its responses.

A GRPO batch holds each prompt `rollout.n` times. Here the rows of a (micro-)batch that share a prompt (the same
real prompt tokens and positions, whatever their left padding) become one sequence,

    [prompt | response_1 | response_2 | ... | response_m]

run under an attention mask where the prompt is causal in itself and each response sees the prompt and its own
earlier tokens only, with every token at the position it had in its own row. Each response token then gets exactly
the hidden state it gets in its own row (the same attention inputs, summed in a different order), so log-probs,
entropies and gradients equal the ungrouped forward's up to rounding, while the prompt's tokens are computed once per
group instead of once per response. The first token of every response is predicted from the prompt's last hidden
state, which the group shares.

lathe's decoder only (`LatheCausalLM.hidden_grouped`); a response token may not follow padding (the rollout's
left-padded prompt, right-padded response layout). The attention runs with an explicit (L x L) mask per group, so
through SDPA's masked kernels rather than flash/varlen attention: its memory grows with the square of a group's
length (prompt + all its responses). It pays when prompts are long next to their responses; with long responses
the per-row packed forward (`use_remove_padding`) can be the cheaper one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lathe.batch import Batch

BAD_LAYOUT = ("use_prefix_grouper: a response token follows a padding position (attention_mask 0): the batch must "
              "be a left-padded prompt followed by a right-padded response, as rollout.base.to_batch builds it")


@dataclass
class GroupedLayout:
    """The grouped rows of a batch: G sequences of length L, and where each real response token's predictor sits."""
    input_ids: torch.Tensor      # (G, L)
    position_ids: torch.Tensor   # (G, L)
    attn_mask: torch.Tensor      # (G, 1, L, L) bool, True where a query sees a key
    source: torch.Tensor         # (N,) flat index into (G * L) of the hidden state that predicts each response token
    valid: torch.Tensor          # (B, R) bool: the real response tokens, in the order of `source`


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
    seqs, where = [], {}                  # where[row] = (group, offset of its response in the group's sequence)
    for g, ((prompt, prompt_pos), rows) in enumerate(groups.items()):
        if not prompt:
            raise ValueError("use_prefix_grouper: a row has an empty prompt; a response needs a prompt token before it")
        tokens, positions, segment = list(prompt), list(prompt_pos), [0] * len(prompt)
        for j, row in enumerate(rows):
            n = int(lengths[row])
            where[row] = (g, len(tokens))
            tokens += ids[row, P:P + n].tolist()
            positions += pos[row, P:P + n].tolist()
            segment += [j + 1] * n
        seqs.append((tokens, positions, segment, len(prompt)))
    L = max(len(s[0]) for s in seqs)
    G = len(seqs)
    input_ids = torch.zeros(G, L, dtype=ids.dtype)
    position_ids = torch.zeros(G, L, dtype=pos.dtype)
    seg = torch.full((G, L), -1, dtype=torch.long)
    for g, (tokens, positions, segment, _) in enumerate(seqs):
        input_ids[g, :len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
        position_ids[g, :len(tokens)] = torch.tensor(positions, dtype=pos.dtype)
        seg[g, :len(tokens)] = torch.tensor(segment)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    sees = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) | (seg.unsqueeze(-2) == 0)           # own segment or the prompt
    attn_mask = (causal & sees & (seg.unsqueeze(-2) >= 0)) | torch.eye(L, dtype=torch.bool)
    source = []
    for row in range(ids.shape[0]):
        g, offset = where[row]
        prompt_end = seqs[g][3] - 1
        source += [g * L + (offset + i - 1 if i else prompt_end) for i in range(int(lengths[row]))]
    device = batch["input_ids"].device
    return GroupedLayout(input_ids.to(device), position_ids.to(device), attn_mask.unsqueeze(1).to(device),
                         torch.tensor(source, dtype=torch.long, device=device), valid.to(device))


def grouped_hidden(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), valid (B, R)): the final hidden states predicting the N real response tokens, from one
    prefix-grouped forward of lathe's decoder (`LatheCausalLM.hidden_grouped`)."""
    layout = grouped_layout(batch)
    hidden = model.hidden_grouped(layout.input_ids, layout.position_ids, layout.attn_mask)
    return hidden.reshape(-1, hidden.shape[-1])[layout.source], layout.valid
