"""The actor/rollout/reference worker: every call takes a `Batch` and returns one (or metrics).

This is the unit a cluster places: in one process it is a plain object; on Ray it becomes a worker
group behind the same methods. It owns the policy weights, the optimizer, the frozen reference
copy and the rollout backend.

Actor and reference run lathe's own decoder when it implements the architecture
(`actor_rollout_ref.model.impl`, see `lathe.models.hf.select_impl`); the HF `generate` rollout keeps the
transformers module it was given, and receives the actor's weights (same names) after every update. When
the actor is itself that transformers module, actor and rollout share it and nothing is copied.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from lathe.algo import ROLLOUT_CORRECTION_KEYS
from lathe.batch import Batch
from lathe.models.decoder import LatheCausalLM
from lathe.models.hf import select_impl
from lathe.rollout.base import SamplingParams, to_batch
from lathe.rollout.hf import HFRollout
from lathe.train.actor import PPOActor
from lathe.train.logprob import batched_log_probs
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.update import load_trainable, save_trainable


class ActorRolloutRefWorker:
    def __init__(self, cfg, model, tokenizer, *, total_steps: int, device: torch.device, need_ref: bool):
        arr = cfg.actor_rollout_ref
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        rollout_model = model.to(device)
        self.model = select_impl(rollout_model, arr.model.impl, role="actor")
        self.remove_padding = arr.model.use_remove_padding
        if isinstance(self.model, LatheCausalLM):
            rollout_model.requires_grad_(False)   # the rollout's copy: written by update_weights only
            if arr.model.enable_gradient_checkpointing:
                self.model.gradient_checkpointing_enable()
        self.ref = _frozen_copy(self.model) if need_ref else None
        self.optimizer = build_optimizer(self.model.parameters(), arr.actor.optim)
        self.scheduler = build_scheduler(self.optimizer, arr.actor.optim, total_steps)
        self.actor = PPOActor(self.model, self.optimizer, self.scheduler, arr.actor, n=arr.rollout.n,
                              temperature=arr.rollout.temperature,
                              max_response_length=cfg.data.max_response_length,
                              rollout_correction={k: getattr(cfg.algorithm.rollout_correction, k)
                                                  for k in ROLLOUT_CORRECTION_KEYS},
                              use_remove_padding=self.remove_padding)
        self.rollout = _build_rollout(arr.rollout, rollout_model, tokenizer)
        self.log_prob_micro_batch_size = (arr.rollout.log_prob_micro_batch_size_per_gpu
                                          or self.actor.micro_batch_size)

    # -- rollout ------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; returns the prompt rows repeated n times plus the tensors."""
        prompt_ids = [list(p) for p in prompts["prompt_ids"]]
        out = self.rollout.generate(prompt_ids, params)
        gen = to_batch(prompt_ids, out, self.tokenizer.pad_token_id, params.n)
        return prompts.repeat(params.n, interleave=True).update(gen)

    # -- log-probs ------------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the responses (`old_log_probs`) and their entropy."""
        logp, ent = batched_log_probs(self.model, batch.to(self.device), micro_batch_size=self.log_prob_micro_batch_size,
                                      temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                                      calculate_entropy=True, remove_padding=self.remove_padding)
        return Batch({"old_log_probs": logp.cpu(), "entropys": ent.cpu()})

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        micro = self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu or self.log_prob_micro_batch_size
        logp, _ = batched_log_probs(self.ref, batch.to(self.device), micro_batch_size=micro,
                                    temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                                    remove_padding=self.remove_padding)
        return Batch({"ref_log_prob": logp.cpu()})

    # -- training -------------------------------------------------------------------------------
    def update_actor(self, batch: Batch) -> dict[str, float]:
        metrics = self.actor.update_policy(batch.to(self.device))
        self.sync_rollout_weights()
        return metrics

    def sync_rollout_weights(self) -> None:
        """Push the actor's weights into the rollout (a no-op for tensors the two already share)."""
        self.rollout.update_weights(self.model.state_dict().items())

    # -- checkpoint -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """HF-format weights (loadable by transformers) and tokenizer, plus optimizer and scheduler state."""
        save_trainable(path, self.model, self.optimizer, self.scheduler)
        self.tokenizer.save_pretrained(path / "huggingface")

    def load_checkpoint(self, path: Path) -> None:
        load_trainable(path, self.model, self.optimizer, self.scheduler, what="actor",
                       ignore_missing=lambda name: _is_tied(self.model, name))
        self.sync_rollout_weights()


def _build_rollout(rollout_cfg, model, tokenizer):
    if rollout_cfg.name != "hf":
        raise ValueError(f"actor_rollout_ref.rollout.name={rollout_cfg.name!r} is not available yet; "
                         "use actor_rollout_ref.rollout.name=hf")
    return HFRollout(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     max_num_seqs=rollout_cfg.max_num_seqs or 1024)


def _frozen_copy(model):
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def _is_tied(model, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)
