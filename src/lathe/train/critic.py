"""The PPO critic for ``algorithm.adv_estimator=gae``: value predictions and the clipped value-loss update.

Batch sizes follow verl's ``critic.*`` keys exactly as the actor's do: one step's sequences are cut into
mini-batches of ``ppo_mini_batch_size * rollout.n`` sequences (one optimizer step each, ``ppo_epochs``
passes) and each mini-batch into micro-batches of ``ppo_micro_batch_size_per_gpu`` sequences whose
gradients add up. The value loss is normalised by the token/sequence counts of the whole mini-batch
(``global_batch_info``), so the update does not depend on the micro-batch size.

Alignment (verl ``dp_critic._forward_micro_batch``): the value of response token t is read off the hidden
state of the position that predicts it, ``values[:, -R-1:-1]`` -- V(s_t) is the value of the prefix
before token t is emitted, the state in which the policy chose it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import torch

from lathe.algo import compute_value_loss, global_batch_info, masked_mean
from lathe.batch import Batch
from lathe.models.compile import maybe_compile
from lathe.models.decoder import LatheValueModel
from lathe.train import parallel
from lathe.train.gathered import accumulating, kept_gathered
from lathe.train.logprob import group_budget, response_hidden, scatter_response, sequence_parallel_response
from lathe.train.micro import in_batch_order, micro_batches
from lathe.train.offload import activations_on_host
from lathe.train.ulysses import SequenceParallel
from lathe.train.update import (EpochShuffle, NonFiniteGuard, clipped_step, load_policy_checkpoint, run_ppo_epochs,
                                save_model_checkpoint)

__all__ = ["response_values", "PPOCritic"]

log = logging.getLogger("lathe")


def response_values(model, batch: Batch, *, remove_padding: bool = False,
                    sp: SequenceParallel | None = None) -> torch.Tensor:
    """Values (B, R) float32 of the response positions, zero where ``response_mask`` is 0.

    lathe's ``LatheValueModel`` reads the head off the real response positions only, from a packed forward
    when ``remove_padding`` (verl's ``critic.model.use_remove_padding``); a transformers model runs padded.
    ``sp``: this rank's sequence-parallel group computes the batch together (`lathe.train.ulysses`; packed).
    """
    if sp is not None:
        if not (isinstance(model, LatheValueModel) and remove_padding):
            raise ValueError("Ulysses sequence parallelism runs lathe's value model packed (critic.model."
                             f"use_remove_padding=true); got {type(model).__name__}, remove_padding={remove_padding}")
        values, flat = sequence_parallel_response(model, batch, sp, lambda hidden, _: model.score(hidden).float())
        values = scatter_response(values[:, 0], flat, tuple(batch["responses"].shape))
        return values * batch["response_mask"].to(values.dtype)
    if isinstance(model, LatheValueModel):
        hidden, valid = response_hidden(model, batch, remove_padding=remove_padding)
        values = scatter_response(model.score(hidden).squeeze(-1).float(), valid)
        return values * batch["response_mask"].to(values.dtype)
    R = batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    values = out.logits[:, -R - 1:-1, 0].float()
    return values * batch["response_mask"].to(values.dtype)


class PPOCritic:
    """Owns the value module and its optimizer; ``update_critic`` runs one RL step's value updates."""

    def __init__(self, model, optimizer, scheduler, critic_cfg, *, mini_batch_size: int, max_response_length: int,
                 use_remove_padding: bool = False, nonfinite: NonFiniteGuard | None = None,
                 sp: SequenceParallel | None = None, tp=None, offload_activations: bool = False):
        """`sp`: this rank's sequence-parallel group (`critic.ulysses_sequence_parallel_size`), `tp`: its tensor-
        parallel group (`critic.model.fsdp_config.tensor_parallel_size`), `offload_activations`
        (`critic.model.enable_activation_offload`): as `PPOActor`'s."""
        self.offload_activations = offload_activations
        self.model, self.optimizer, self.scheduler, self.cfg = model, optimizer, scheduler, critic_cfg
        self.nonfinite = nonfinite or NonFiniteGuard("critic")
        self.use_remove_padding = use_remove_padding
        # verl's critic.model.fsdp_config.use_torch_compile: compile the value model's decoder layers, on CUDA
        fsdp = critic_cfg.model.fsdp_config          # tensor or expert parallelism: eager
        self.compiled = maybe_compile(model, fsdp.use_torch_compile and tp is None and fsdp.expert_parallel_size <= 1)
        self.mini_batch_size = mini_batch_size        # this rank's share, in sequences (BatchPlan)
        self.micro_batch_size = critic_cfg.ppo_micro_batch_size_per_gpu or self.mini_batch_size
        self.forward_micro_batch_size = critic_cfg.forward_micro_batch_size_per_gpu or self.micro_batch_size
        dynamic = critic_cfg.use_dynamic_bsz        # (verl: token budgets instead of sequence counts)
        self.sp, self.data_group = sp, parallel.data_group(sp, tp)
        self.max_token_len, self.max_token_key = group_budget(
            critic_cfg.ppo_max_token_len_per_gpu if dynamic else None, "critic.ppo_max_token_len_per_gpu", sp)
        self.forward_max_token_len, self.forward_max_token_key = group_budget(
            critic_cfg.forward_max_token_len_per_gpu if dynamic else None, "critic.forward_max_token_len_per_gpu", sp)
        self.loss_scale_factor = max_response_length

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``{"values": (B, R)}`` in eval mode, ``forward_micro_batch_size_per_gpu`` sequences at a time."""
        was_training = self.model.training
        self.model.eval()
        try:
            with kept_gathered(self.model):     # one FSDP2 gather for the pass where it fits
                parts = [(response_values(self.model, mb, remove_padding=self.use_remove_padding, sp=self.sp), rows)
                         for mb, rows in micro_batches(batch, size=self.forward_micro_batch_size,
                                                       max_tokens=self.forward_max_token_len,
                                                       key=self.forward_max_token_key)]
        finally:
            self.model.train(was_training)
            parallel.reshard(self.model)
        return Batch({"values": in_batch_order(parts)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches; verl's ``critic/*`` metrics averaged over mini-batches.

        Needs ``values`` (old predictions, the clipping centre) and ``returns`` besides the sequence tensors.
        """
        self.model.train()
        shuffle = EpochShuffle(self.cfg.data_loader_seed, self.scheduler.last_epoch) if self.cfg.shuffle else None
        out = run_ppo_epochs(batch, epochs=self.cfg.ppo_epochs, mini_batch_size=self.mini_batch_size,
                             update_mini_batch=self._update_mini_batch, shuffle=shuffle)
        self.scheduler.step()
        out["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _update_mini_batch(self, mini: Batch) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        mask = mini["response_mask"]
        agg = global_batch_info(mask, self.loss_scale_factor)      # summed over data-parallel ranks
        tokens, seqs = parallel.all_reduce([agg["global_num_tokens"], agg["global_num_seqs"]],
                                           group=self.data_group).tolist()
        agg.update(global_num_tokens=int(tokens), global_num_seqs=int(seqs))
        total_tokens = max(1, agg["global_num_tokens"])
        # metrics stay on the device until the mini-batch ends (as the actor's): no host wait per micro-batch
        sums: dict[str, float | torch.Tensor] = defaultdict(float)
        micros = [m for m, _ in micro_batches(mini, size=self.micro_batch_size, max_tokens=self.max_token_len,
                                              key=self.max_token_key)]
        for micro in accumulating(self.model, micros):     # one FSDP2 gather a mini-batch where it fits
            with activations_on_host(self.offload_activations):
                loss, parts = self._micro_batch_loss(micro, agg)
            loss.backward()
            share = micro["response_mask"].sum().double() / total_tokens   # token-weighted: exact mini-batch means
            sums["critic/vf_loss"] = sums["critic/vf_loss"] + loss.detach().double()   # global normalisation: add up
            for k, v in parts.items():
                sums[k] = sums[k] + v * share
        out = parallel.sum_metrics({k: float(v) for k, v in sums.items()}, self.data_group)
        out["critic/grad_norm"] = clipped_step(self.model, self.optimizer, self.cfg.grad_clip)
        out["critic/skipped_updates"] = self.nonfinite.check(out["critic/grad_norm"], mini)
        return out

    def _micro_batch_loss(self, micro: Batch, agg: dict) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro["response_mask"]
        vpreds = response_values(self.model, micro, remove_padding=self.use_remove_padding, sp=self.sp)
        loss, clipfrac = compute_value_loss(vpreds, micro["returns"], micro["values"], mask, self.cfg.cliprange_value,
                                            loss_agg_mode=self.cfg.loss_agg_mode, agg_kwargs=agg)
        parts = {"critic/vf_clipfrac": torch.as_tensor(clipfrac).detach().double(),
                 "critic/vpred_mean": masked_mean(vpreds.detach(), mask).double()}
        return loss, parts

    # -- checkpoint -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Path, *, base_model: str | None = None) -> None:
        """Weights and optimizer state; a LoRA critic's adapter and head (`lathe.train.lora.save_lora`, PEFT's
        TOKEN_CLS layout) beside the merged model. `base_model`: the path a LoRA adapter names as its base."""
        save_model_checkpoint(Path(path), self.model, self.optimizer, self.scheduler, base_model=base_model)

    def load_checkpoint(self, path: Path) -> None:
        load_policy_checkpoint(Path(path), self.model, self.optimizer, self.scheduler, what="critic")
