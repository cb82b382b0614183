"""`lathe sft`'s worker: one per device (`lathe.loop.sft` drives it, in process or as a Ray worker group of FSDP2
ranks), built from the SFT config's `model`, `optim` and `data` groups."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lathe.batch import Batch
from lathe.config.plan import MeshPlan
from lathe.device import reset_peak_memory
from lathe.models.compile import maybe_compile
from lathe.models.decoder import LatheCausalLM
from lathe.models.hf import select_impl
from lathe.models.lora import apply_lora
from lathe.models.rope import cast_keeping_rope
from lathe.models.vl import is_vl
from lathe.train import lora, parallel
from lathe.train.gathered import accumulating
from lathe.train.actor import use_torch_compile
from lathe.train.logprob import response_log_probs
from lathe.train.micro import micro_batches
from lathe.train.offload import offload_flags
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.precision import resolve_policy
from lathe.train.recompute import enable_recompute
from lathe.train.update import clipped_step, load_policy_checkpoint, save_policy_checkpoint

log = logging.getLogger("lathe")


class SFTWorker:
    """The model, its optimizer and schedule on one device (a rank of an FSDP2 group when in one): `train_step`
    takes a batch of `sft_batch` rows (this rank's share of the step's), `eval_loss` a validation batch."""

    def __init__(self, cfg, model, tokenizer, *, total_steps: int, device: torch.device, mesh: MeshPlan | None = None):
        """`mesh`: the model's (`lathe.config.sft.sft_mesh`; None: plain FSDP) on a rank of a group."""
        m, d = cfg.model, cfg.data
        self.tokenizer, self.device = tokenizer, device
        self.model = select_impl(model, m.impl, role="actor", key="model.impl")
        self.lora = m.lora_rank > 0
        if self.lora:
            if not isinstance(self.model, LatheCausalLM):
                raise ValueError("model.lora_rank > 0 needs lathe's decoder (the architectures of "
                                 "lathe.models.SUPPORTED_ARCHITECTURES), but the model runs on the transformers "
                                 "fallback. Fix: set model.lora_rank=0, or use an architecture lathe's decoder "
                                 "implements.")
            apply_lora(self.model, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules,
                       seed=cfg.trainer.seed)
        self.base_model = m.path
        enable_recompute(self.model, m.enable_gradient_checkpointing, m.gradient_checkpointing_layers, "model",
                         lathe=isinstance(self.model, LatheCausalLM) or is_vl(self.model), impl_key="model.impl")
        key = "model.fsdp_config"
        self.policy = resolve_policy(m.fsdp_config, device, key=key)
        self.sharded = parallel.in_group()
        if self.lora:                     # the frozen base in the compute dtype; only the adapters train
            lora.place(self.model, self.policy, device, sharded=self.sharded)
        else:                             # sharded: fully_shard moves each rank's shards to the device
            cast_keeping_rope(self.model, self.policy.master_dtype, None if self.sharded else device)
        if self.sharded:
            parallel.shard(self.model, m.fsdp_config, self.policy, device, mesh)
            self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, sharded=True, fsdp_key=key,
                                             **offload_flags(m.fsdp_config, device, key=key, sharded=True))
        else:
            self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, policy=self.policy, fsdp_key=key,
                                             **offload_flags(m.fsdp_config, device, key=key))
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps)
        maybe_compile(self.model, use_torch_compile(m))
        self.packed = isinstance(self.model, LatheCausalLM)      # the varlen forward: no compute on padding
        self.micro_batch_size = d.micro_batch_size_per_gpu
        self.max_tokens = d.max_token_len_per_gpu if d.use_dynamic_bsz else None
        self.grad_clip = cfg.optim.clip_grad if cfg.optim.clip_grad is not None else 1.0
        log.info("sft: %s on %s%s", self.policy.describe(), device, parallel.mesh_note(mesh))

    def _micro(self, batch: Batch):
        return micro_batches(batch, size=self.micro_batch_size, max_tokens=self.max_tokens,
                             key="data.max_token_len_per_gpu")

    def _nll(self, micro: Batch) -> torch.Tensor:
        """Summed negative log-likelihood of the micro-batch's trained tokens."""
        log_probs, _ = response_log_probs(self.model, micro, remove_padding=self.packed)
        return -(log_probs * micro["response_mask"].to(log_probs.dtype)).sum()

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step: the mean NLL over every trained token of the step's batch (all ranks together),
        whatever the micro-batches; verl's `train/loss`, `train/grad_norm`, `train/lr`, and on a GPU the step's
        `perf/max_memory_{allocated,reserved}_gb`."""
        self.model.train()
        reset_peak_memory(self.device)
        batch = batch.to(self.device)
        tokens, _ = parallel.global_counts(batch["response_mask"])
        total = 0.0
        for micro in accumulating(self.model, [m for m, _ in self._micro(batch)]):   # lathe.train.gathered
            loss = self._nll(micro) / tokens
            loss.backward()
            total += float(loss.detach())
        out = parallel.sum_metrics({"train/loss": total})
        out["train/grad_norm"] = clipped_step(self.model, self.optimizer, self.grad_clip)
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        return {**out, **parallel.peak_memory_metrics(self.device)}     # the step's peak, the largest over ranks

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> dict[str, float]:
        """(summed NLL, trained tokens) of a validation batch, summed over the ranks."""
        self.model.eval()
        try:
            batch = batch.to(self.device)
            nll = sum(float(self._nll(micro)) for micro, _ in self._micro(batch))
        finally:
            self.model.train()
            parallel.reshard(self.model)
        return parallel.sum_metrics({"nll": nll, "tokens": float(batch["response_mask"].sum())})

    def save_checkpoint(self, path: Path) -> None:
        """The layout of `lathe train`'s actor: `huggingface/` (weights + tokenizer; with LoRA the merged model, and
        the adapter in PEFT's layout under `lora_adapter/`) and `optim.pt`."""
        save_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, self.tokenizer,
                               base_model=self.base_model)

    def load_checkpoint(self, path: Path) -> None:
        load_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, what="sft")
