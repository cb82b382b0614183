"""Prefix-grouped forward (verl's `actor.use_prefix_grouper`): each prompt runs once for all its responses.

A GRPO batch holds each prompt `rollout.n` times. Here the rows of a (micro-)batch that share a prompt (the same
real prompt tokens and positions, whatever their left padding) become segments of one packed stream, every
group's prompt first, then every response:

    [prompt_1 | prompt_2 | ... | prompt_G | response_1,1 | ... | response_1,m | response_2,1 | ... ]

(the prompts and the responses each one contiguous block, which linear-attention layers slice rather than gather),
where a prompt's segment attends causally to itself and each response's segment to the prompt, then causally to
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

import numpy as np
import torch

from lathe.batch import Batch
from lathe.device import array_to_device
from lathe.models.attention import GroupedAttention, GroupedLinear
from lathe.train.micro import HOST_MASK, HOST_PROMPT_IDS, HOST_PROMPT_POS

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
    flat: torch.Tensor           # (N,) each real response token's position in the flattened (B * R) responses,
    #                              in the order of `source` (rows in order, each row's tokens in order)
    host_bounds: tuple[list[int], list[int]]     # cu_q and cu_k on the host
    linear: GroupedLinear | None = None          # where the model has linear-attention layers (`grouped_layout`)

    def attention(self, backend: str) -> GroupedAttention:
        return GroupedAttention(self.cu_q, self.cu_k, self.kv_index, self.max_q, self.max_k, backend, self.host_bounds,
                                self.linear)


def _host(batch: Batch, key: str, device_value) -> np.ndarray:
    """The host copy `key` that `lathe.train.micro.with_host_mask` took once for the whole batch, or a copy now
    (a host sync) where the batch has none."""
    host = batch.tensors.get(key)
    if host is None:
        host = device_value()
    return (host if host.device.type == "cpu" else host.cpu()).numpy()     # (a batch moved whole moved it too)


@dataclass
class HostStream:
    """`grouped_layout`'s facts as host (numpy) arrays."""
    src: np.ndarray          # (T,) each stream token's place in the flattened (B * L) batch
    kv: np.ndarray           # (Tk,) `GroupedLayout.kv_index`
    cu_q: list[int]
    cu_k: list[int]
    source: np.ndarray       # (N,) `GroupedLayout.source`
    flat: np.ndarray         # (N,) `GroupedLayout.flat`
    every: np.ndarray        # (M,) every real token of every row, flattened (B * L) ...
    held: np.ndarray         # (M,) ... and the stream token holding it (a prompt's tokens: its group's, once)
    group: np.ndarray        # (S,) each segment's group (its prompt's index among the groups)
    prompt: np.ndarray       # (S,) bool: the segment is its group's prompt


def host_stream(batch: Batch) -> HostStream:
    """Group the batch's rows by prompt (see the module docstring), on the host, from the batch's host copies of
    its mask and prompts (`with_host_mask(..., prompts=True)`: taken once per pass, so that building a micro-batch's
    layout waits for no device work)."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = _host(batch, HOST_MASK, lambda: batch["attention_mask"]).astype(bool)
    ids = _host(batch, HOST_PROMPT_IDS, lambda: batch["input_ids"][:, :P])
    pos = _host(batch, HOST_PROMPT_POS, lambda: batch["position_ids"][:, :P])
    B, L = mask.shape
    valid = mask[:, P:]
    lengths = valid.sum(-1)
    if (valid != (np.arange(R)[None, :] < lengths[:, None])).any():
        raise ValueError(BAD_LAYOUT)
    groups: dict[tuple, list[int]] = {}
    for row in range(B):
        real = mask[row, :P]
        groups.setdefault((ids[row, real].tobytes(), pos[row, real].tobytes()), []).append(row)
    src, kv, cu_q, cu_k, every, held, group, is_prompt = [], [], [0], [0], [], [], [], []
    predictor, start = np.zeros(B, np.int64), np.zeros(B, np.int64)
    shared = []                         # each group's prompt tokens (in its first row) and their stream rows
    for index, rows in enumerate(groups.values()):          # every prompt's segment first, then every response's
        prompt = np.flatnonzero(mask[rows[0], :P])
        if not len(prompt):
            raise ValueError("use_prefix_grouper: a row has an empty prompt; a response needs a prompt token before it")
        shared.append((prompt, np.arange(cu_q[-1], cu_q[-1] + len(prompt))))
        src.append(rows[0] * L + prompt)
        kv.append(shared[-1][1])
        cu_q.append(cu_q[-1] + len(prompt))
        cu_k.append(cu_k[-1] + len(prompt))
        group.append(index)
        is_prompt.append(True)
    for index, rows in enumerate(groups.values()):
        prompt, prompt_rows = shared[index]
        for row in rows:
            n = int(lengths[row])
            predictor[row], start[row] = prompt_rows[-1], cu_q[-1]
            every.append(row * L + prompt)
            held.append(prompt_rows)
            if n == 0:
                continue
            own = np.arange(cu_q[-1], cu_q[-1] + n)
            kv += [prompt_rows, own]
            src.append(row * L + P + np.arange(n))
            every.append(src[-1])
            held.append(own)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + len(prompt) + n)
            group.append(index)
            is_prompt.append(False)
    source = [np.concatenate([[predictor[row]], np.arange(start[row], start[row] + lengths[row] - 1)])
              for row in range(B) if lengths[row]]
    return HostStream(np.concatenate(src), np.concatenate(kv), cu_q, cu_k,
                      np.concatenate(source) if source else np.zeros(0, np.int64), np.flatnonzero(valid),
                      np.concatenate(every), np.concatenate(held), np.asarray(group, np.int64),
                      np.asarray(is_prompt, bool))


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _bounds(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def linear_layout(host: HostStream, kernel: int, device: torch.device) -> GroupedLinear:
    """The stream as linear-attention layers run it (`GroupedLinear`), for a short convolution of `kernel` taps:
    worked out on the host, moved without waiting for the device. The prompts' segments lead the stream
    (`host_stream`), so the prompts are its first rows and the responses the rest, in order."""
    cu = np.asarray(host.cu_q, np.int64)
    lengths = np.diff(cu)
    prompts, responses = np.flatnonzero(host.prompt), np.flatnonzero(~host.prompt)
    ends = cu[prompts + 1][host.group[responses]]                    # each response's prompt's end in the stream
    tails = np.minimum(kernel - 1, lengths[prompts][host.group[responses]])
    extended = [np.concatenate([np.arange(end - tail, end), np.arange(cu[s], cu[s + 1])])
                for end, tail, s in zip(ends, tails, responses)]
    cu_extended = _bounds(tails + lengths[responses])
    kept = _concat([np.arange(start + tail, stop) for start, stop, tail in zip(cu_extended[:-1], cu_extended[1:],
                                                                                 tails)])
    move = lambda a, dtype=torch.int64: array_to_device(np.asarray(a), device, dtype)   # noqa: E731
    cu_prompt = _bounds(lengths[prompts])
    cu_conv = np.concatenate([cu_prompt, cu_prompt[-1] + cu_extended[1:]])
    return GroupedLinear(int(cu_prompt[-1]), move(cu_prompt, torch.int32),
                         int(lengths[prompts].max(initial=1)), move(_concat(extended)),
                         move(cu_conv, torch.int32), move(kept),
                         move(_bounds(lengths[responses]), torch.int32), int(lengths[responses].max(initial=1)),
                         move(host.group[responses]))


def grouped_layout(batch: Batch, conv_kernel: int | None = None) -> GroupedLayout:
    """`host_stream`'s layout on the batch's device, moved without waiting for it; the stream's ids and positions
    gathered on the device. `conv_kernel`: the model has linear-attention layers with a short convolution of so many
    taps (`linear_layout`)."""
    host = host_stream(batch)
    device = batch["input_ids"].device
    src = array_to_device(host.src, device)
    return GroupedLayout(batch["input_ids"].flatten()[src], batch["position_ids"].flatten()[src],
                         array_to_device(np.asarray(host.cu_q), device, torch.int32),
                         array_to_device(np.asarray(host.cu_k), device, torch.int32),
                         array_to_device(host.kv, device), int(np.diff(host.cu_q).max()),
                         int(np.diff(host.cu_k).max()), array_to_device(host.source, device),
                         array_to_device(host.flat, device), (host.cu_q, host.cu_k),
                         None if conv_kernel is None else linear_layout(host, conv_kernel, device))


def grouped_hidden(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), flat (N,)): the final hidden states predicting the N real response tokens, from one
    prefix-grouped forward of lathe's decoder (`LatheCausalLM.hidden_grouped`), and those tokens' positions in the
    flattened (B * R) responses (`GroupedLayout.flat`)."""
    cfg = model.config
    kernel = (cfg.linear_attention.conv_kernel if cfg.linear_attention is not None else
              cfg.nemotron.mamba.conv_kernel if cfg.nemotron is not None else None)
    layout = grouped_layout(batch, kernel)
    hidden = model.hidden_grouped(layout.input_ids, layout.position_ids, layout.attention(model.packed_backend()))
    return hidden[layout.source], layout.flat
