"""Sampling the next token for a whole batch at once: temperature, top-k, top-p, min_tokens; greedy at T=0.

The returned log-prob is `log_softmax(logits / T)` of the chosen token over the full vocabulary, T=1 for
greedy: the quantity the trainer recomputes (and `HFRollout` returns), not the truncated distribution
that top-k/top-p sampled from. `min_tokens` bans the stop ids from being sampled, never from the log-prob.

Every row may have its own settings; the work is a few (B, V) tensor passes, with no per-row loop on the
device. On CUDA, batches without a min_tokens ban in force go through the fused Triton sampler instead
(`triton_sample.py`, which a decode step's CUDA graph also captures; top-k/top-p without a sort), the same draw
from the same uniform numbers, up to float summation order.

Randomness is inverse-CDF sampling from one uniform number per row, `uniforms(seed, t)`: splitmix64 of
the sequence's seed and its output position t. A sequence samples the same tokens whatever else shares
its batch, and after preemption.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from lathe.device import to_device
from lathe.engine.sequence import Sequence


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """Uniform floats in [0, 1) (53 random bits) for (seed, position) pairs: splitmix64 of
    `seed * golden + (position + 1) * c`, in numpy uint64 arithmetic (which wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = (np.array(seeds, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + (np.array(positions, dtype=np.uint64) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | int, top_p: torch.Tensor | float, *,
                      use_k: bool | None = None, k_max: int | None = None, use_p: bool | None = None
                      ) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and outside the smallest set holding its `top_p` mass.

    Order as transformers' warpers and vLLM: top-k first, then top-p over what is left. Ties are kept or dropped
    whole: top-k keeps every token at the k-th largest value, top-p every token whose value's tie group starts
    with less than `top_p` of the mass ranked above it (the fused kernel's rule, `triton_sample.py`; a sort's
    order among equal values decides nothing). `logits` (V,) or
    (B, V); `top_k` (B,) or an int (<= 0 disables), `top_p` (B,) or a float (1 disables). `use_k` / `use_p`
    (whether any row uses top-k / top-p) and `k_max` (the largest k, V for a row without top-k): when the caller
    knows them; otherwise they are asked of the device, which waits for it.
    """
    squeeze = logits.dim() == 1
    x = logits[None] if squeeze else logits
    b, v = x.shape
    k = torch.as_tensor(top_k, device=x.device).expand(b)
    p = torch.as_tensor(top_p, device=x.device, dtype=torch.float32).expand(b)
    k = torch.where((k <= 0) | (k >= v), torch.full_like(k, v), k)
    if use_k if use_k is not None else bool((k < v).any()):
        top = torch.topk(x, int(k.max()) if k_max is None else min(k_max, v), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if use_p if use_p is not None else bool((p < 1).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs                      # mass of the tokens ranked above each one
        starts = torch.ones_like(sorted_x, dtype=torch.bool)   # first of its tie group: all share its `before`
        starts[:, 1:] = sorted_x[:, 1:] != sorted_x[:, :-1]
        before = torch.where(starts, before, float("-inf")).cummax(-1).values
        remove = before >= torch.where(p < 1, p, torch.full_like(p, float("inf")))[:, None]
        remove[:, 0] = False
        x = x.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))
    return x[0] if squeeze else x


def _shared_params(seqs: list[Sequence]):
    """The one `SequenceParams` every sequence holds (a `generate` call makes one), else None."""
    first = seqs[0].params
    return first if all(s.params is first for s in seqs) else None


class FusedSettings(NamedTuple):
    """What the fused sampler needs of a batch: each field a scalar when every row shares it (a `generate` call)
    or a per-row list; `use_k` / `use_p` whether any sampled row has top-k / top-p (the searches run only then)."""

    greedy: int | list[int]
    temperature: float | list[float]
    top_k: int | list[int]
    top_p: float | list[float]
    use_k: bool
    use_p: bool


def fused_settings(device: torch.device, vocab: int, seqs: list[Sequence]) -> FusedSettings | None:
    """The batch's `FusedSettings`, or None when the fused Triton sampler cannot sample it (not CUDA, no Triton, or
    a min_tokens ban in force)."""
    if device.type != "cuda":
        return None
    from lathe.engine.triton_sample import triton
    if triton is None:
        return None
    shared = _shared_params(seqs)
    params = [shared] if shared is not None else [s.params for s in seqs]
    if any(p.min_tokens and p.stop_token_ids for p in params) and any(
            s.num_output_tokens < s.params.min_tokens and s.params.stop_token_ids for s in seqs):
        return None
    use_k = any(not p.greedy and 0 < p.top_k < vocab for p in params)
    use_p = any(not p.greedy and p.top_p < 1 for p in params)
    if shared is not None:      # runs at every decode step: per-sequence lists only where they differ
        return FusedSettings(int(shared.greedy), shared.logprob_temperature, shared.top_k, shared.top_p, use_k, use_p)
    return FusedSettings([int(p.greedy) for p in params], [p.logprob_temperature for p in params],
                         [p.top_k for p in params], [p.top_p for p in params], use_k, use_p)


FUSED_ROWS = 6


def fused_rows(seqs: list[Sequence], settings: FusedSettings) -> np.ndarray:
    """(FUSED_ROWS, B) int64 host rows the fused sampler reads: seeds, output positions, greedy flags, temperatures
    (float64 bit patterns, `.view(torch.float64)` on the device), top-k, top-p (float64 bit patterns)."""
    rows = np.empty((FUSED_ROWS, len(seqs)), dtype=np.int64)
    rows[0] = [s.seed or 0 for s in seqs]
    rows[1] = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]
    rows[2] = settings.greedy
    rows[3] = np.asarray(settings.temperature, dtype=np.float64).view(np.int64)
    rows[4] = settings.top_k
    rows[5] = np.asarray(settings.top_p, dtype=np.float64).view(np.int64)
    return rows


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None,
                use_k: bool = False, use_p: bool = False) -> torch.Tensor:
    """The fused sampler over `fused_rows` already on the device ((FUSED_ROWS, B) int64); `out` as `fused_sample`
    takes it; the top-k / top-p searches run when `use_k` / `use_p`."""
    from lathe.engine.triton_sample import fused_sample
    return fused_sample(logits, rows[3].view(torch.float64).float(), rows[2].int(), rows[0], rows[1], out=out,
                        top_k=rows[4] if use_k else None,
                        top_p=rows[5].view(torch.float64).float() if use_p else None)


def _sample_fused(logits: torch.Tensor, seqs: list[Sequence], settings: FusedSettings) -> torch.Tensor:
    rows = to_device(torch.from_numpy(fused_rows(seqs, settings)), logits.device)
    return sample_rows(logits, rows, use_k=settings.use_k, use_p=settings.use_p)


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """(2, B) float64 on the logits' device: row 0 the token ids, row 1 their log-probs; one row of `logits`
    (B, V) per sequence (computed in float32). Nothing here waits for the device: the engine copies the
    result to the host while the next step runs."""
    settings = fused_settings(logits.device, logits.shape[-1], seqs)
    if settings is not None:
        return _sample_fused(logits, seqs, settings)
    return sample_torch(logits, seqs)


def ban(logits: torch.Tensor, banned: list[tuple[int, int]]) -> torch.Tensor:
    """`logits` with the (row, token) pairs `banned` (stop ids before min_tokens) at -inf (a copy when any)."""
    if not banned:
        return logits
    rows, toks = to_device(torch.tensor(banned), logits.device).T
    return logits.index_put((rows, toks), torch.tensor(float("-inf"), device=logits.device))


def top_k_top_p(x: torch.Tensor, params: list) -> torch.Tensor:
    """Row i of `x` (temperature-scaled logits) filtered by `params[i]`'s top-k then top-p, as lathe samples (only
    when some row asks for it)."""
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    v = x.shape[-1]
    effective_k = [k if 0 < k < v else v for k in top_k]
    use_k, use_p = min(effective_k) < v, any(p < 1 for p in top_p)
    if not (use_k or use_p):
        return x
    return apply_top_k_top_p(x, to_device(torch.tensor(top_k), x.device), to_device(torch.tensor(top_p), x.device),
                             use_k=use_k, k_max=max(effective_k), use_p=use_p)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids (...) drawn from `probs` (..., V) with the uniforms `u` (...): the first id whose cumulative mass
    exceeds u x the total (the total as summed, so rounding cannot run past the last id)."""
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[..., -1])[..., None], right=True)[..., 0]
    return drawn.clamp_(max=probs.shape[-1] - 1)


def sample_torch(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`sample_on_device` in PyTorch operations (a sort for top-p, `topk` for top-k): the path for the CPU and for
    rows with a min_tokens ban in force, and the fused sampler's reference."""
    logits = logits.float()
    device = logits.device
    params = [s.params for s in seqs]
    temps = to_device(torch.tensor([p.logprob_temperature for p in params]), device)[:, None]
    banned = [(row, tok) for row, (s, p) in enumerate(zip(seqs, params))
              if s.num_output_tokens < p.min_tokens for tok in p.stop_token_ids]
    masked = ban(logits, banned)
    tokens = masked.argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = to_device(torch.tensor(sampled), device) if len(sampled) < len(seqs) else None
        x = masked if rows is None else masked[rows]
        x = top_k_top_p(x / (temps if rows is None else temps[rows]), [params[i] for i in sampled])
        u = to_device(torch.from_numpy(uniforms([seqs[i].seed or 0 for i in sampled],
                                                [seqs[i].num_output_tokens for i in sampled])), device)
        drawn = inverse_cdf(x.softmax(-1), u)
        if rows is None:
            tokens = drawn
        else:
            tokens = tokens.index_copy(0, rows, drawn)
    logprobs = torch.log_softmax(logits / temps, -1).gather(1, tokens[:, None])[:, 0]
    return torch.stack([tokens.double(), logprobs.double()])


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) for logits (B, V), one row per sequence: `sample_on_device`, on the host."""
    both = sample_on_device(logits, seqs).tolist()     # one device-to-host copy
    return [int(t) for t in both[0]], both[1]
