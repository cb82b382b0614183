"""Training a policy's multi-token-prediction (MTP) layers beside the RL loss (verl's `actor_rollout_ref.model.mtp`).

What verl's Megatron actor computes (`verl/models/mcore/mtp_patch.py`, `model_forward.py`), here over lathe's packed
micro-batches: MTP layer k (`lathe.models.mtp`) reads the main model's final hidden state at position t and the
embedding of token t+k+1 and predicts token t+k+2. Its loss is the cross-entropy of those predictions through the
shared `lm_head`, taken with `lm_head`'s weight detached (verl: the MTP loss never updates `lm_head`), without the
sampling temperature (Megatron's raw logits), over the positions whose target token is a response token (verl's loss
mask: zeros over the prompt, `response_mask` over the response, shifted with the labels), never across two packed
sequences. The loss added to the policy loss is

    mtp_loss_scaling_factor / num_mtp_layers * sum_k  CE_k,   CE_k = sum of token losses / the mini-batch's count

counted over the whole mini-batch (every micro-batch and data-parallel rank: Megatron's per-token global mean), so
gradient accumulation does not change it. `detach_encoder=true`: no gradient from the MTP loss reaches the main
model's hidden states or the token embeddings (only the MTP layers learn from it). CE_k is logged unscaled as verl
logs Megatron's tracker: `actor/mtp_losses/mtp_<k+1>_loss`. The reference and old-log-prob passes never run MTP.

Under Ulysses sequence parallelism (`lathe.train.ulysses`; verl's Megatron context parallelism) each rank of a group
runs the MTP layers on its slice of the packed stream, their attention under the main forward's `UlyssesAttention`
(an MTP layer is a decoder layer of the main model's heads). The ids, targets and loss mask are shifted over the whole
stream (every rank of the group holds the micro-batch) before the rank's slice is taken, so a slice's last positions
read the tokens of the next rank's slice, and never a next sequence's. Each rank's loss is the sum over its slice's
tokens (divided by the mini-batch's count, summed over the data-parallel ranks only: each token counted once), so the
group's losses add up to the micro-batch's, and so do its gradients (as FSDP2 sums them); the logged CE_k is summed
over the group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lathe.batch import Batch
from lathe.models.attention import PackedAttention
from lathe.models.mtp import has_mtp, mtp_stream, roll_packed
from lathe.train import parallel
from lathe.train.logprob import LOGPROB_CHUNK_SIZE, PackedStream
from lathe.train.vocab_parallel import token_stats

log = logging.getLogger("lathe")
METRIC_PREFIX = "actor/mtp_losses/"
KEY = "actor_rollout_ref.model.mtp"


@dataclass(frozen=True)
class MtpTraining:
    """What the actor's update needs of `actor_rollout_ref.model.mtp` when `enable` and `enable_train` are on."""

    scaling_factor: float         # mtp_loss_scaling_factor
    detach_encoder: bool
    num_layers: int               # the policy's MTP layers


def mtp_training(mtp_cfg, model, what: str) -> MtpTraining | None:
    """The MTP update of `model` (the policy, named `what` in errors), or None when `mtp.enable` or `mtp.enable_train`
    is off. A policy without MTP layers fails here, naming the model and the key."""
    if not (mtp_cfg.enable and mtp_cfg.enable_train):
        return None
    if not has_mtp(model):
        raise ValueError(f"{KEY}.enable_train=true, but the policy {what} has no multi-token-prediction layers "
                         "(lathe trains MiMo's model.mtp_layers: MiMoForCausalLM with num_nextn_predict_layers >= 1 "
                         f"and the layers' tensors in the checkpoint). Fix: set {KEY}.enable_train=false (or "
                         f"{KEY}.enable=false), or point actor_rollout_ref.model.path at a checkpoint with MTP layers.")
    return MtpTraining(float(mtp_cfg.mtp_loss_scaling_factor), bool(mtp_cfg.detach_encoder),
                       len(model.model.mtp_layers))


# transformers' classes of the families whose checkpoints hold MTP layers lathe's decoder loads but does not run
UNRUN_MTP_CLASSES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "HYV3ForCausalLM", "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


def keep_checkpoint_mtp(mtp_cfg, model, path: str) -> None:
    """`mtp.enable=true` with a policy whose checkpoint holds MTP layers lathe's decoder loads but does not run
    (DeepSeek-V3's, GLM-4.5's, HY-V3's `model.layers.<n>`, the hybrids' `mtp.*`: `lathe.models.io.unrun_mtp`): every
    checkpoint the policy saves carries them, copied unchanged from `path` (verl keeps them with mtp.enable, frozen
    unless enable_train), so that the trained model still serves with MTP speculative decoding (the drafts then come
    from the original layers). Where the policy cannot (transformers' module, model.impl=hf; lathe's vision-language
    model of a Qwen3.5 checkpoint) this fails, naming the key."""
    if not mtp_cfg.enable or has_mtp(model):
        return
    from lathe.models.decoder import LatheCausalLM
    from lathe.models.hf import direct_checkpoint_dir
    from lathe.models.io import unrun_mtp, weight_files
    name, text = type(model).__name__, getattr(getattr(model, "config", None), "text", None)
    if not isinstance(model, LatheCausalLM):
        if name in UNRUN_MTP_CLASSES or getattr(text, "linear_attention", None) is not None:
            raise ValueError(f"{KEY}.enable=true: the policy runs as {name}, whose saves leave out the checkpoint's "
                             "MTP layers (lathe copies them into the saves of its text decoder only: "
                             f"model.impl=auto with a text checkpoint or text data). Fix: set {KEY}.enable=false")
        return
    cfg = model.config
    source = cfg.vl_checkpoint[0] if cfg.vl_checkpoint is not None else direct_checkpoint_dir(path)
    if source is None or not any(unrun_mtp(n, cfg) for n in _tensor_names(weight_files(source))):
        log.warning("%s.enable=true: %s holds no multi-token-prediction layers that lathe's decoder leaves unrun, so "
                    "its saves carry none", KEY, path)
        return
    cfg.mtp_source = str(source)
    log.info("%s.enable=true: the MTP layers of %s are copied unchanged into every checkpoint the policy saves "
             "(lathe's decoder does not run them)", KEY, path)


def _tensor_names(files) -> set[str]:
    """The tensor names of checkpoint files, read from their headers (a `.bin`'s by memory-mapping it)."""
    from safetensors import safe_open
    names: set[str] = set()
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as handle:
                names.update(handle.keys())
        else:
            names.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True).keys())
    return names


def full_response_mask(batch: Batch) -> torch.Tensor:
    """(B, L) float: 0 over the prompts, `response_mask` over the responses (verl's MTP loss mask)."""
    mask = batch["response_mask"]
    full = mask.new_zeros(batch["attention_mask"].shape, dtype=torch.float32)
    full[:, -mask.shape[1]:] = mask.float()
    return full


def token_counts(mini: Batch, mtp: MtpTraining, group=None) -> torch.Tensor:
    """(num_layers,) float64: for each MTP layer k, the mini-batch's MTP-loss tokens over every data-parallel rank:
    response tokens at sequence position >= k + 2 (those with a position t = theirs - k - 2 to be predicted from)."""
    attn = mini["attention_mask"]
    seq_pos = attn.long().cumsum(-1) - 1
    full = full_response_mask(mini)
    counts = [float((full * (seq_pos >= k + 2)).sum()) for k in range(mtp.num_layers)]
    return parallel.all_reduce(counts, group=group).double()


def mtp_loss(model, micro: Batch, stream: PackedStream, counts: torch.Tensor, mtp: MtpTraining
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro-batch's share of the scaled MTP loss, {`actor/mtp_losses/mtp_<k>_loss`: its share of CE_k}) from the
    main forward's `stream` (`lathe.train.logprob.PackedStream`); `counts` from `token_counts` (module doc). Under
    Ulysses the loss is the share of this rank's slice, the metrics the group's whole micro-batch's."""
    cu = stream.cu_seqlens
    attn = stream.attn or PackedAttention(cu, int(stream.max_seqlen), model.packed_backend())
    outs = mtp_stream(model, stream.hidden, stream.input_ids, stream.position_ids, cu, attn,
                      detach_encoder=mtp.detach_encoder, local=stream.local)
    targets = roll_packed(stream.input_ids, cu)   # shifted over the whole stream, then this rank's slice taken
    weights = roll_packed(full_response_mask(micro).flatten()[stream.indices], cu)
    head = model.lm_head.weight.detach()          # verl: the MTP loss does not train lm_head
    total, parts = None, {}
    for k, hidden in enumerate(outs):
        targets, weights = roll_packed(targets, cu), roll_packed(weights, cu)      # token t + k + 2
        mine = stream.local(weights)
        chosen = mine > 0
        if bool(chosen.any()):
            logp = token_stats(hidden[chosen], head, stream.local(targets)[chosen], temperature=1.0,
                               chunk_size=LOGPROB_CHUNK_SIZE,
                               compile_backend=getattr(model, "compile_backend", None))[0]
            ce = -(logp * mine[chosen].to(logp.dtype)).sum() / counts[k].clamp(min=1.0).to(logp.dtype)
        else:                                      # keep the layer in the graph: every rank reduces its gradients
            ce = hidden.sum() * 0.0
        parts[f"{METRIC_PREFIX}mtp_{k + 1}_loss"] = ce.detach()
        total = ce if total is None else total + ce
    if stream.sp is not None:                      # each rank's CE_k is its slice's share: the metric is the group's
        shares = torch.stack(list(parts.values()))
        dist.all_reduce(shares, group=stream.sp.group)
        parts = dict(zip(parts, shares.unbind()))
    return total * (mtp.scaling_factor / mtp.num_layers), parts
