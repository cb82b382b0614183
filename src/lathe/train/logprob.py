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

A vision-language model (`lathe.models.vl.LatheVLForConditionalGeneration`) runs the same two paths; each
(micro-)batch gives it the images of its own rows (`multi_modal_inputs`, one entry per row, None for text rows:
`image_inputs`) and 3D M-RoPE positions computed from its tokens and image grids (`vl_positions`; the batch's 1D
`position_ids` are not used: the response tokens are text and continue after the prompt's largest position).

A lathe model compiled by `lathe.models.compile.compile_decoder` (the actor with `use_torch_compile`) also
runs the chunked log-prob/entropy math compiled, with the same backend.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from lathe.batch import Batch
from lathe.device import array_to_device
from lathe.models.decoder import LatheCausalLM
from lathe.models.attention import PackedAttention
from lathe.models.logprob import response_token_stats as padded_token_stats
from lathe.models.packing import pack_padded
from lathe.models.vl import LatheVLForConditionalGeneration, mrope_positions
from lathe.train import parallel
from lathe.train.gathered import kept_gathered
from lathe.train.micro import HOST_MASK, in_batch_order, micro_batches
from lathe.train.prefix_group import grouped_hidden
from lathe.train.ulysses import SequenceParallel, UlyssesAttention, gather_tokens, local_slice, padded_length
from lathe.train.vocab_parallel import token_stats, vocab_sharded

# (hidden states (n, H) of the positions that predict n response tokens, those tokens' places in the flattened
# (B * R) responses) -> (n, k) values per token: what a sequence-parallel forward reads off its slice
ReadFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

LOGPROB_CHUNK_SIZE = 1024   # tokens per lm_head chunk: peak extra memory ~ chunk x vocab x 4 bytes (x3 in backward)


def response_valid(batch: Batch) -> torch.Tensor:
    """(B, R) bool: the real response tokens."""
    return batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()


def response_positions(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid (B, R) bool, source (N,)): the real response tokens, and for each, the flat index into the
    (B * L) padded batch of the position whose hidden state predicts it (the position before it)."""
    B, L = batch["input_ids"].shape
    R = batch["responses"].shape[1]
    valid = response_valid(batch)
    rows = torch.arange(B, device=valid.device).unsqueeze(1) * L
    cols = torch.arange(L - R - 1, L - 1, device=valid.device).unsqueeze(0)
    return valid, (rows + cols)[valid]


@dataclass
class HostLayout:
    """Where a micro-batch's real tokens and response tokens sit, worked out on the host from its attention mask
    (`lathe.train.micro.HOST_MASK`) and copied to the device without waiting for it: what `pack_padded` and boolean
    indexing would find on the device, each at the cost of a host sync."""
    indices: torch.Tensor        # (T,) real tokens in the flattened (B * L) batch
    cu_seqlens: torch.Tensor     # (B+1,) int32
    max_seqlen: int
    index: torch.Tensor          # (N,) the packed position whose hidden state predicts each real response token
    flat: torch.Tensor           # (N,) each real response token's position in the flattened (B * R) responses


def host_layout(batch: Batch) -> HostLayout | None:
    """The batch's `HostLayout`, or None when it carries no host mask (then the device works it out). Raises, as
    `response_hidden` does, when a response token follows a padding position."""
    host = batch.tensors.get(HOST_MASK)
    if host is None or host.shape != batch["attention_mask"].shape:
        return None
    indices, seqlens, index, flat = host_arrays(host, batch["responses"].shape[1])
    device = batch["attention_mask"].device
    return HostLayout(indices=array_to_device(indices, device),
                      cu_seqlens=array_to_device(np.concatenate([[0], np.cumsum(seqlens)]), device, torch.int32),
                      max_seqlen=int(seqlens.max()) if len(seqlens) else 0, index=array_to_device(index, device),
                      flat=array_to_device(flat, device))


def host_arrays(host_mask: torch.Tensor, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`HostLayout`'s facts as numpy arrays, from a (B, L) attention mask in host memory whose last R columns are
    the responses: (indices (T,), seqlens (B,), index (N,), flat (N,)); `index` ascends (rows in order, each row's
    response positions in order)."""
    # numpy: single-threaded (torch's CPU ops wake their thread pool per op, slow on a busy host; see to_batch)
    mask = host_mask.numpy().astype(bool)
    B, L = mask.shape
    seqlens = mask.sum(-1)
    indices = np.flatnonzero(mask)
    valid = mask[:, L - R:]
    source = (np.arange(B)[:, None] * L + np.arange(L - R - 1, L - 1)[None, :])[valid]
    where = np.full(B * L, -1, dtype=np.int64)
    where[indices] = np.arange(len(indices))
    index = where[source]
    if (index < 0).any():
        raise ValueError(BAD_LAYOUT)
    return indices, seqlens, index, np.flatnonzero(valid)


BAD_LAYOUT = ("a response token follows a padding position (attention_mask 0): the batch must be a left-padded "
              "prompt followed by a right-padded response, as rollout.base.to_batch builds it")


@dataclass
class PackedStream:
    """A text model's whole packed forward, kept for a second read-out (`lathe.train.mtp`): the final hidden states
    and positions of the tokens this process computed (all T real tokens; a sequence-parallel rank's slice of the
    padded stream, `sp`), the ids of all T, the sequence bounds, each token's index in the flattened (B * L) batch,
    and, under sequence parallelism, the forward's attention (`UlyssesAttention`) and the group."""
    hidden: torch.Tensor         # (n, H): n = T, or this rank's padded_length(T) / S
    input_ids: torch.Tensor      # (T,)
    position_ids: torch.Tensor   # (n,)
    cu_seqlens: torch.Tensor     # (B+1,) int32, over the T real tokens
    max_seqlen: int
    indices: torch.Tensor        # (T,)
    attn: UlyssesAttention | None = None
    sp: SequenceParallel | None = None

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This process's tokens of a whole-stream (T, ...) tensor (zeros past the stream: the group's padding)."""
        return x if self.sp is None else local_slice(x, self.sp)


def response_hidden(model, batch: Batch, *, remove_padding: bool = False, layout: HostLayout | None = None,
                    keep: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (N, H), valid (B, R)): final hidden states predicting the N real response tokens of a lathe model
    (`LatheCausalLM`, `LatheValueModel`, or `LatheVLForConditionalGeneration` with the rows' images), from a packed
    forward when `remove_padding`, else a padded one. A text model's packed forward takes its positions from
    `layout` (or the batch's `host_layout`) when there is one: no host sync. `keep`: a text model's packed forward
    appends its `PackedStream` to it."""
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    vl = isinstance(model, LatheVLForConditionalGeneration)
    if remove_padding and not vl:
        layout = layout or host_layout(batch)
        if layout is not None:
            stream = PackedStream(None, ids.flatten()[layout.indices], pos.flatten()[layout.indices],
                                  layout.cu_seqlens, layout.max_seqlen, layout.indices)
            stream.hidden = model.hidden_packed(stream.input_ids, stream.position_ids, layout.cu_seqlens,
                                                layout.max_seqlen)
            if keep is not None:
                keep.append(stream)
            return stream.hidden[layout.index], response_valid(batch)
    valid, source = response_positions(batch)
    images = image_inputs(batch, model.device) if vl else {}
    if vl:                      # 3D positions and the prompts' placeholders, as the engine saw them
        pos3, images["image_mask"] = vl_positions(model, batch, images.get("image_grid_thw"))
    if not remove_padding:
        hidden = model.hidden_padded(ids, mask, pos3 if vl else pos, **images)
        return hidden.reshape(-1, hidden.shape[-1])[source], valid
    packed = pack_padded(ids, mask, pos)
    positions = packed.position_ids
    if vl:
        positions = pos3.reshape(3, -1)[:, packed.indices]
        images["image_mask"] = images["image_mask"].reshape(-1)[packed.indices]
    hidden = model.hidden_packed(packed.input_ids, positions, packed.cu_seqlens, packed.max_seqlen, **images)
    if keep is not None and not vl:
        keep.append(PackedStream(hidden, packed.input_ids, positions, packed.cu_seqlens, packed.max_seqlen,
                                 packed.indices))
    where = torch.full((ids.numel(),), -1, dtype=torch.long, device=ids.device)
    where[packed.indices] = torch.arange(len(packed.indices), device=ids.device)
    index = where[source]
    if bool((index < 0).any()):
        raise ValueError(BAD_LAYOUT)
    return hidden[index], valid


def group_budget(max_tokens: int | None, key: str, sp: SequenceParallel | None) -> tuple[int | None, str]:
    """(a micro-batch's token budget, its name in errors): the per-device budget `key`, x the sequence-parallel
    group's size (verl's rule: the group's devices compute each micro-batch together, each 1/size of its tokens)."""
    if max_tokens is None or sp is None:
        return max_tokens, key
    return max_tokens * sp.size, f"{key} x ulysses_sequence_parallel_size={sp.size}"


def sequence_parallel_response(model, batch: Batch, sp: SequenceParallel, read: ReadFn, keep: list | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, k), flat (N,)): `read`'s k values of each of the batch's N real response tokens, computed by a
    sequence-parallel group (`lathe.train.ulysses`), and each token's place in the flattened (B * R) responses.

    The packed stream (worked out on the host, the same on every rank of the group) is padded to a multiple of the
    group's size, the pad being a sequence of its own; this rank runs lathe's decoder (`hidden_with`) on its slice
    under `UlyssesAttention`, calls `read(hidden (n, H), tokens (n,))` on the hidden states that predict the response
    tokens in its slice (`tokens`: their places in the flattened responses), and the slices' values are gathered.
    `keep`: the rank's `PackedStream` is appended to it (the MTP loss, `lathe.train.mtp`)."""
    host = batch.tensors.get(HOST_MASK)
    if host is None or host.shape != batch["attention_mask"].shape:
        host = batch["attention_mask"].cpu()
    indices, seqlens, index, flat = host_arrays(host, batch["responses"].shape[1])
    device, T = batch["input_ids"].device, len(indices)
    total = padded_length(T, sp.size)
    per, pad = total // sp.size, total - T
    real = array_to_device(indices, device)
    whole_ids = batch["input_ids"].flatten()[real]
    ids, pos = local_slice(whole_ids, sp), local_slice(batch["position_ids"].flatten()[real], sp)
    bounds = np.concatenate([[0], np.cumsum(seqlens), [total] * bool(pad)])
    attn = UlyssesAttention(PackedAttention(array_to_device(bounds, device, torch.int32), int(max(seqlens.max(), pad)),
                                            model.packed_backend()), sp)
    if isinstance(model, LatheVLForConditionalGeneration):     # the whole stream's images and 3D positions
        images = image_inputs(batch, device)
        pos3, placeholders = vl_positions(model, batch, images.get("image_grid_thw"))
        hidden = model.hidden_with(whole_ids, pos3.reshape(3, -1)[:, real], attn, **images,
                                   image_mask=placeholders.reshape(-1)[real])
    else:
        hidden = model.hidden_with(ids, pos, attn)
    if keep is not None:
        cu = array_to_device(bounds[:len(seqlens) + 1], device, torch.int32)
        keep.append(PackedStream(hidden, whole_ids, pos, cu, int(seqlens.max()), real, attn, sp))
    lo = sp.rank * per
    mine = (index >= lo) & (index < lo + per)
    rows = array_to_device(index[mine] - lo, device)
    out = read(hidden[rows], array_to_device(flat[mine], device))
    slab = out.new_zeros(per, out.shape[1]).index_put((rows,), out)
    return gather_tokens(slab, sp)[array_to_device(index, device)], array_to_device(flat, device)


def _sequence_parallel_stats(model, batch: Batch, sp: SequenceParallel, *, temperature: float, chunk_size: int,
                             wanted: tuple[bool, bool, bool], keep: list | None = None
                             ) -> tuple[torch.Tensor | None, ...]:
    """`response_token_stats` of a sequence-parallel group: the (log-prob, entropy, sum pi^2) asked for by `wanted`,
    each computed on the rank's slice by `chunked_token_stats` and gathered (`sequence_parallel_response`)."""
    targets = batch["responses"].flatten()

    def read(hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        stats = token_stats(hidden, model.lm_head.weight, targets[tokens], temperature=temperature,
                            chunk_size=chunk_size, calculate_entropy=wanted[1], calculate_sum_pi_squared=wanted[2],
                            compile_backend=getattr(model, "compile_backend", None))
        return torch.stack([x for x in stats if x is not None], dim=-1)
    values, flat = sequence_parallel_response(model, batch, sp, read, keep)
    columns = iter(values.unbind(-1))
    return tuple(scatter_response(next(columns), flat, tuple(batch["responses"].shape)) if want else None
                 for want in wanted)


def image_inputs(batch: Batch, device: torch.device | str) -> dict[str, torch.Tensor]:
    """{"pixel_values" (patches, D), "image_grid_thw" (images, 3)} of the batch's rows, images in row order, on
    `device`; {} when the batch has no `multi_modal_inputs` column or no row has images. Micro-batches are
    `Batch.select`s, so each carries exactly its own rows' images."""
    if "multi_modal_inputs" not in batch:
        return {}
    from lathe.data.multimodal import concat_multi_modal_inputs
    joined = concat_multi_modal_inputs(list(batch["multi_modal_inputs"]))
    return {k: v.to(device) for k, v in joined.items()}


def vl_positions(model, batch: Batch, image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (3, B, L), image placeholder mask (B, L)) of a padded prompt+response batch for a VL model.

    Only the prompts hold placeholders: an image (or video) token the policy generated is a text token at a text
    position, as the engine ran it (a response token i sits at i + the prompt's rope delta on every axis), so the
    positions are computed with such tokens read as text."""
    c = model.config
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    prompt[:, :batch["prompts"].shape[1]] = True
    special = (ids == c.image_token_id) | (ids == c.video_token_id)
    positions, _ = mrope_positions(torch.where(special & ~prompt, torch.zeros_like(ids), ids), image_grid_thw, mask,
                                   image_token_id=c.image_token_id, video_token_id=c.video_token_id,
                                   spatial_merge_size=c.spatial_merge_size)
    return positions, (ids == c.image_token_id) & prompt


def scatter_response(values: torch.Tensor, valid: torch.Tensor, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """(N,) values of the real response tokens -> (B, R), 0 at padding. Differentiable. `valid`: the (B, R) mask,
    or the tokens' flat positions (`HostLayout.flat`) with the (B, R) `shape`."""
    if valid.dtype == torch.bool:
        return values.new_zeros(valid.shape).masked_scatter(valid, values)
    return values.new_zeros(shape[0] * shape[1]).index_put((valid,), values).view(shape)


def response_log_probs(model, batch: Batch, *, temperature: float = 1.0, calculate_entropy: bool = False,
                       remove_padding: bool = False, prefix_grouper: bool = False,
                       chunk_size: int = LOGPROB_CHUNK_SIZE, sp: SequenceParallel | None = None,
                       keep: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs (B, R), entropy (B, R) or None) float32 of `batch["responses"]`.

    `remove_padding` and `chunk_size` apply to lathe's decoder and VL model; a transformers model always runs
    padded. `prefix_grouper` (verl's `actor.use_prefix_grouper`, lathe's text decoder): rows that share a prompt
    run it once (`lathe.train.prefix_group`). `sp`: this rank's sequence-parallel group computes the batch together
    (lathe's text decoder, packed: `sequence_parallel_response`); every rank of it gets the whole batch's results.
    `keep`: see `response_token_stats`.
    """
    logp, entropy, _ = response_token_stats(model, batch, temperature=temperature,
                                            calculate_entropy=calculate_entropy, remove_padding=remove_padding,
                                            prefix_grouper=prefix_grouper, chunk_size=chunk_size, sp=sp, keep=keep)
    return logp, entropy


def response_token_stats(model, batch: Batch, *, temperature: float = 1.0, calculate_entropy: bool = False,
                         calculate_sum_pi_squared: bool = False, remove_padding: bool = False,
                         prefix_grouper: bool = False, chunk_size: int = LOGPROB_CHUNK_SIZE,
                         sp: SequenceParallel | None = None, keep: list | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`response_log_probs` plus, with `calculate_sum_pi_squared` (verl's `actor.calculate_sum_pi_squared`), each
    response token's sum over the vocabulary of p^2 (B, R) float32, no gradient, 0 at padding; else None. lathe's
    models compute it in the log-prob pass's own chunks; a transformers model from its full logits. `keep`: lathe's
    text decoder runs packed (the same numbers at real tokens as a padded forward) and appends its `PackedStream`
    (`response_hidden`; under `sp`, the rank's slice: `sequence_parallel_response`), for the MTP loss
    (`lathe.train.mtp`)."""
    if keep is not None:
        if not isinstance(model, LatheCausalLM) or prefix_grouper:
            raise ValueError("the packed stream (multi-token prediction) needs lathe's text decoder without "
                             f"use_prefix_grouper; got {type(model).__name__}")
        remove_padding = True
    if sp is not None:
        if not (isinstance(model, (LatheCausalLM, LatheVLForConditionalGeneration)) and remove_padding
                and not prefix_grouper):
            raise ValueError("Ulysses sequence parallelism runs lathe's text decoder (or VL model) packed "
                             "(use_remove_padding=true) "
                             f"without use_prefix_grouper; got {type(model).__name__}, remove_padding="
                             f"{remove_padding}, prefix_grouper={prefix_grouper}")
        return _sequence_parallel_stats(model, batch, sp, temperature=temperature, chunk_size=chunk_size,
                                        wanted=(True, calculate_entropy, calculate_sum_pi_squared), keep=keep)
    if prefix_grouper and not isinstance(model, LatheCausalLM):
        raise ValueError("actor_rollout_ref.actor.use_prefix_grouper=true needs lathe's text decoder (Llama, Qwen2, "
                         f"Qwen3, Qwen3.5, GPT-OSS ...), but the actor runs {type(model).__name__}. Fix: set "
                         "use_prefix_grouper=false.")
    if isinstance(model, LatheCausalLM) and not remove_padding and not prefix_grouper and vocab_sharded(
            model.lm_head.weight):      # tensor-parallel: the hidden states of every (B, R) position, as below
        R = batch["responses"].shape[1]
        hidden = model.hidden_padded(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        return token_stats(hidden[:, -R - 1:-1], model.lm_head.weight, batch["responses"], temperature=temperature,
                           chunk_size=chunk_size, calculate_entropy=calculate_entropy,
                           calculate_sum_pi_squared=calculate_sum_pi_squared)
    if isinstance(model, LatheCausalLM) and not remove_padding and not prefix_grouper:
        return padded_token_stats(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  batch["responses"], temperature=temperature, chunk_size=chunk_size,
                                  calculate_entropy=calculate_entropy,
                                  calculate_sum_pi_squared=calculate_sum_pi_squared)
    if isinstance(model, (LatheCausalLM, LatheVLForConditionalGeneration)):
        packed_text = remove_padding and isinstance(model, LatheCausalLM) and not prefix_grouper
        layout = host_layout(batch) if packed_text else None
        if prefix_grouper:
            hidden, where = grouped_hidden(model, batch)
        else:
            hidden, valid = response_hidden(model, batch, remove_padding=remove_padding, layout=layout, keep=keep)
            where = layout.flat if layout is not None else valid
        targets = batch["responses"].flatten()[where] if where.dtype != torch.bool else batch["responses"][where]
        stats = token_stats(hidden, model.lm_head.weight, targets, temperature=temperature, chunk_size=chunk_size,
                            calculate_entropy=calculate_entropy, calculate_sum_pi_squared=calculate_sum_pi_squared,
                            compile_backend=getattr(model, "compile_backend", None))
        return tuple(None if x is None else scatter_response(x, where, batch["responses"].shape) for x in stats)
    responses = batch["responses"]
    R = responses.shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, -R - 1:-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = sum_sq = None
    if calculate_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    if calculate_sum_pi_squared:
        sum_sq = torch.exp(torch.logsumexp(2.0 * logp_all.detach(), dim=-1))
    return log_probs, entropy, sum_sq


@torch.no_grad()
def batched_log_probs(model, batch: Batch, *, micro_batch_size: int, temperature: float = 1.0,
                      calculate_entropy: bool = False, remove_padding: bool = False,
                      max_tokens: int | None = None, max_tokens_key: str = "log_prob_max_token_len_per_gpu",
                      sp: SequenceParallel | None = None, prefix_grouper: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` over micro-batches (`micro_batch_size` sequences, or packed by `max_tokens`: see
    `lathe.train.micro`), in eval mode, without gradients; rows in the batch's order. `sp`, `prefix_grouper`: as
    `response_log_probs`; a packed micro-batch then holds up to `max_tokens` x the group's size (verl's budget: per
    device, and a group of devices computes each micro-batch)."""
    log_probs, entropy, _ = batched_token_stats(model, batch, micro_batch_size=micro_batch_size,
                                                temperature=temperature, calculate_entropy=calculate_entropy,
                                                remove_padding=remove_padding, prefix_grouper=prefix_grouper,
                                                max_tokens=max_tokens, max_tokens_key=max_tokens_key, sp=sp)
    return log_probs, entropy


@torch.no_grad()
def batched_token_stats(model, batch: Batch, *, micro_batch_size: int, temperature: float = 1.0,
                        calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False,
                        remove_padding: bool = False, prefix_grouper: bool = False, max_tokens: int | None = None,
                        max_tokens_key: str = "log_prob_max_token_len_per_gpu", sp: SequenceParallel | None = None,
                        around=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`batched_log_probs` plus the per-token sum over the vocabulary of p^2 when `calculate_sum_pi_squared`
    (`response_token_stats`), else None in its place. `around(micro_batch, its rows)`: a context each micro-batch's
    forward runs in (routing replay, `lathe.train.routing.LogProbRouting`)."""
    was_training = model.training
    model.eval()
    max_tokens, max_tokens_key = group_budget(max_tokens, max_tokens_key, sp)
    try:
        parts = []
        with kept_gathered(model):          # one FSDP2 gather for the pass where it fits (lathe.train.gathered)
            for mb, rows in micro_batches(batch, size=micro_batch_size, max_tokens=max_tokens, key=max_tokens_key,
                                          grouped=prefix_grouper):
                with around(mb, rows) if around is not None else nullcontext():
                    parts.append((response_token_stats(model, mb, temperature=temperature,
                                                       calculate_entropy=calculate_entropy,
                                                       calculate_sum_pi_squared=calculate_sum_pi_squared,
                                                       remove_padding=remove_padding, prefix_grouper=prefix_grouper,
                                                       sp=sp), rows))
    finally:
        model.train(was_training)
        parallel.reshard(model)
    wanted = (True, calculate_entropy, calculate_sum_pi_squared)
    return tuple(in_batch_order([(p[i], rows) for p, rows in parts]) if want else None
                 for i, want in enumerate(wanted))
