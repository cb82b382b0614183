"""The `Rollout` interface: prompts plus `SamplingParams` in; response ids, log-probs and finish reasons out.

Backends (lathe's engine, transformers' `generate`, the agent loop on either) implement `Rollout`; the engine
does so structurally, without importing this module. `to_batch` turns their output into the tensors the rest of
the step reads (see `lathe.batch` for the layout); `concat_rollouts` joins such batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from lathe.batch import Batch
from lathe.generation import RolloutOutput, SamplingParams

ROUTED = "routed_experts"       # routing replay's per-token experts (lathe.train.routing)


class Rollout(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *, first_index: int = 0
                 ) -> RolloutOutput:
        """`first_index`: the place of this call's first sample in a larger call split over ranks (seeding)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def to_batch(prompt_token_ids: list[list[int]], out: RolloutOutput, pad_id: int, n: int) -> Batch:
    """Left-pad prompts, right-pad responses, and build the masks and positions for the trainer.

    `prompt_token_ids` are the unrepeated prompts; each is repeated `n` times to line up with `out`. An output with
    `loss_masks` (the agent loop's: tool answers appended between model turns) sets `response_mask` from them;
    `attention_mask` covers every response token either way.
    """
    loss_masks = getattr(out, "loss_masks", None) or None
    # (a custom agent loop's output carries each sample's own prompt)
    prompts = getattr(out, "prompt_ids", None) or [p for p in prompt_token_ids for _ in range(n)]
    if len(prompts) != len(out.token_ids):
        raise ValueError(f"rollout returned {len(out.token_ids)} samples for {len(prompts)} (prompts x n)")
    for name, per_token in (("logprobs", out.logprobs), ("loss_masks", loss_masks)):
        if per_token is None:
            continue
        bad = next((i for i, (r, x) in enumerate(zip(out.token_ids, per_token)) if len(r) != len(x)),
                   None if len(per_token) == len(prompts) else min(len(per_token), len(prompts)))
        if bad is not None:
            raise ValueError(f"rollout output: {name} of sample {bad} do not line up with its tokens (one value per "
                             f"token; {len(per_token)} samples of {name} for {len(prompts)})")
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in out.token_ids))
    # numpy throughout: single-threaded, where torch's CPU kernels wake their thread pool for every (B, L) op, which
    # is slow on a busy many-core GPU host
    prompt_ids, prompt_mask = _padded(prompts, P, pad_id, np.int64, left=True)
    resp_ids, resp_mask = _padded(out.token_ids, R, pad_id, np.int64)
    logp, _ = _padded(out.logprobs, R, 0.0, np.float32)
    attention_mask = np.concatenate([prompt_mask, resp_mask], axis=1).astype(np.int64)
    resp_mask = torch.from_numpy(resp_mask.astype(np.int64))
    routed = {} if out.routed_experts is None else {ROUTED: _padded_routing(prompts, out, P, R)}
    return Batch(
        tensors={**routed,
            "prompts": torch.from_numpy(prompt_ids),
            "responses": torch.from_numpy(resp_ids),
            "input_ids": torch.from_numpy(np.concatenate([prompt_ids, resp_ids], axis=1)),
            "attention_mask": torch.from_numpy(attention_mask),
            "position_ids": torch.from_numpy(np.maximum(attention_mask.cumsum(-1) - 1, 0)),
            "response_mask": torch.from_numpy(_padded(loss_masks, R, 0, np.int64)[0]) if loss_masks else resp_mask,
            "rollout_log_probs": torch.from_numpy(logp),
        },
        non_tensors={"finish_reason": list(out.finish_reasons)},
    )


def _padded_routing(prompts: list[list[int]], out: RolloutOutput, P: int, R: int) -> torch.Tensor:
    """(B, P + R, layers, k) int16: each sample's recorded routing (`RolloutOutput.routed_experts`, one row per
    prompt and response token) laid out as `input_ids` (left-padded prompt, right-padded response), -1 elsewhere."""
    first = out.routed_experts[0]
    full = torch.full((len(prompts), P + R, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (prompt, resp, rec) in enumerate(zip(prompts, out.token_ids, out.routed_experts)):
        if len(rec) != len(prompt) + len(resp):
            raise ValueError(f"rollout output: routed_experts of sample {i} has {len(rec)} rows for "
                             f"{len(prompt)} prompt + {len(resp)} response tokens")
        full[i, P - len(prompt):P + len(resp)] = rec
    return full


def _padded(rows: list, width: int, fill, dtype, *, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(B, width) array of `rows`, each right-aligned (`left` padding) or left-aligned, `fill` elsewhere, and the
    (B, width) mask of real entries: one vectorised write, not a row-by-row fill."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    cols = np.arange(width)
    mask = cols >= (width - lengths)[:, None] if left else cols < lengths[:, None]
    out = np.full((len(rows), width), fill, dtype=dtype)
    out[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
    return out, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding gets position 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# Which side a (B, width) tensor is padded on when rollout batches of different widths are joined.
_PROMPT_SIDE = {"prompts"}                                        # (B, P), left-padded
_WHOLE_SEQUENCE = {"input_ids", "attention_mask", "position_ids"}  # (B, P + R)
_TOKEN_IDS = {"prompts", "responses", "input_ids"}                # padded with the pad id, the rest with 0


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Join rollout batches whose prompt/response widths differ, re-padding to the widest of each.

    Every other 2-D tensor is response-aligned (B, R) and right-padded; 1-D tensors join as they are.
    """
    P = max(b["prompts"].shape[1] for b in batches)
    R = max(b["responses"].shape[1] for b in batches)
    return Batch.concat([_repad(b, P, R, pad_id) for b in batches])


def _repad(batch: Batch, P: int, R: int, pad_id: int) -> Batch:
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    out = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
    if ROUTED in batch:                                 # (B, P + R, layers, k), laid out as input_ids
        out.tensors[ROUTED] = torch.nn.functional.pad(batch[ROUTED], (0, 0, 0, 0, P - p, R - r), value=-1)
    for key, t in batch.tensors.items():
        if t.dim() != 2:
            continue
        value = pad_id if key in _TOKEN_IDS else 0
        if key in _PROMPT_SIDE:
            out.tensors[key] = torch.nn.functional.pad(t, (P - p, 0), value=value)
        elif key in _WHOLE_SEQUENCE:
            out.tensors[key] = torch.nn.functional.pad(t, (P - p, R - r), value=value)
        else:
            out.tensors[key] = torch.nn.functional.pad(t, (0, R - r), value=value)
    out.tensors["position_ids"] = position_ids_from_mask(out.tensors["attention_mask"])
    return out


def streamed_batch(prompt_ids: list[list[int]], out, pad_id: int, n: int, version: int) -> Batch:
    """A finished streamed request's rows: `to_batch`'s tensors, the weight version each response token was sampled
    with (`rollout_versions`; `version` for an output that records none), the request's engine metrics."""
    batch = to_batch(prompt_ids, out, pad_id, n)
    spans = out.versions or [[(version, 0)] for _ in out.token_ids]
    batch["rollout_versions"] = token_versions(spans, batch["responses"].shape[1])
    batch.meta["rollout_metrics"] = dict(out.metrics)
    return batch


def token_versions(spans: list[list[tuple[int, int]]], width: int) -> torch.Tensor:
    """(B, width) long: the weight version each response token was sampled with, from `RolloutOutput.versions`
    spans ((version, first token index), ascending); padding after a response carries its last version."""
    out = torch.empty(len(spans), width, dtype=torch.long)
    for i, sample in enumerate(spans):
        for k, (version, start) in enumerate(sample):
            end = sample[k + 1][1] if k + 1 < len(sample) else width
            out[i, start:end] = version
    return out
