"""The PPO-family actor update: mini-batches, micro-batch gradient accumulation, clipping, metrics.

Batch sizes follow verl: a step's `train_batch_size * n` sequences are cut into mini-batches of
`ppo_mini_batch_size * n` sequences (one optimizer step each, `ppo_epochs` passes), and each
mini-batch into micro-batches of `ppo_micro_batch_size_per_gpu` sequences whose gradients add up (or, with
`use_dynamic_bsz`, micro-batches packed to `ppo_max_token_len_per_gpu` tokens: `lathe.train.micro`).
Losses are normalised by the token and sequence counts of the whole mini-batch, so the update does
not depend on the micro-batch size.

A mixture-of-experts policy whose config asks for it (`output_router_logits`, as transformers adds its aux loss;
set by `actor_rollout_ref.model.override_config.output_router_logits=true`) adds `router_aux_loss_coef` times the
routers' load-balancing loss of each micro-batch (`lathe.models.moe`), weighted by its share of the mini-batch's
sequences, and reports it as `actor/router_aux_loss`. Megatron's router losses (`moe_aux_loss_coeff`,
`moe_z_loss_coeff`, which verl's Megatron scripts set) are formed per sparse layer and summed over the layers
(`RouterStats.megatron_losses`), weighted the same way, and reported unscaled and averaged over the layers as Megatron
logs them: `actor/load_balancing_loss`, `actor/z_loss`. The routers' statistics are those of the micro-batch's
real tokens (`lathe.train.router_tokens`: no padding, no ghost row's tokens) and its weight its real rows' share, so
a mini-batch padded with ghost rows balances its experts exactly as it would without them.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import nullcontext

import torch

from lathe.algo import agg_loss, get_policy_loss, kl_penalty
from lathe.algo.distillation import DistillationParams, combine_losses, distillation_loss, topk_losses
from lathe.algo.policy_loss import PolicyLossParams
from lathe.algo.rollout_correction import CorrectionPieces, ProbsDiffSums, in_update, is_weights
from lathe.batch import Batch, real_rows
from lathe.models.compile import maybe_compile
from lathe.models.moe import collect_router_stats, megatron_router_coefs, router_aux_loss_coef
from lathe.models.routing import ReplayStats
from lathe.rollout.base import ROUTED
from lathe.train import parallel, ulysses
from lathe.train.gathered import accumulating
from lathe.train.logprob import group_budget, response_log_probs
from lathe.train.micro import micro_batches
from lathe.train.mtp import METRIC_PREFIX as MTP_METRICS, MtpTraining, mtp_loss, token_counts
from lathe.train.offload import activations_on_host
from lathe.train.router_tokens import router_tokens
from lathe.train.routing import replay_counts, replay_or_nothing
from lathe.train.topk import student_topk_log_probs
from lathe.train.ulysses import SequenceParallel
from lathe.train.update import EpochShuffle, NonFiniteGuard, clipped_step, run_ppo_epochs


def policy_loss_params(actor_cfg, rollout_correction: dict | None = None) -> PolicyLossParams:
    """verl's actor keys -> the loss functions' parameters."""
    names = set(PolicyLossParams.__dataclass_fields__) - {"rollout_correction"}
    values = {k: getattr(actor_cfg, k) for k in names if hasattr(actor_cfg, k)}
    values.update({k: getattr(actor_cfg.policy_loss, k) for k in names if hasattr(actor_cfg.policy_loss, k)})
    return PolicyLossParams(**{k: v for k, v in values.items() if v is not None}, rollout_correction=rollout_correction)


class PPOActor:
    """Owns the policy module and its optimizer; `update_policy` runs one RL step's PPO updates."""

    def __init__(self, model, optimizer, scheduler, actor_cfg, *, mini_batch_size: int, temperature: float,
                 max_response_length: int, rollout_correction: dict | None = None, use_remove_padding: bool = False,
                 nonfinite: NonFiniteGuard | None = None, sp: SequenceParallel | None = None, tp=None,
                 distillation: DistillationParams | None = None, offload_activations: bool = False,
                 mtp: MtpTraining | None = None):
        """`mini_batch_size`: this rank's share of a mini-batch, in sequences (`BatchPlan.mini_batch_sequences_per_device`).
        `rollout_correction`: the `algorithm.rollout_correction` keys. With `bypass_mode` on, the loss treats
        `old_log_probs` as the rollout's and corrects against the current policy itself; else an on-policy update
        (a batch without `old_log_probs`) computes the IS weights of a correction that `in_update` allows from its
        own forward, with the `rollout_corr/*` metrics of the whole batch.
        `use_remove_padding` (verl's `model.use_remove_padding`): packed forward for lathe's decoder.
        `use_torch_compile` and `fsdp_config.use_torch_compile` (verl's two spellings; either false turns it off):
        compile lathe's decoder layers and log-prob math, on CUDA (see `lathe.models.compile`).
        `sp`: this rank's sequence-parallel group (`actor.ulysses_sequence_parallel_size`, `lathe.train.ulysses`),
        whose ranks get the same shares and compute each micro-batch together; counts and metrics are summed over
        its `data_group` (the ranks holding distinct data) and the token budget is per group. `tp`: this rank's
        tensor-parallel group (`lathe.train.tensor_parallel.TensorParallel`): its ranks get the same shares too, so
        counts and metrics are summed over its `data_group`; the model then runs eager.
        `distillation` (verl's `distillation.distillation_loss`): the batch carries `teacher_log_probs` and the
        distillation loss joins the task loss (`lathe.algo.distillation`), with verl's `distillation/*` metrics.
        `offload_activations` (verl's `model.enable_activation_offload`): the update's saved activations wait in host
        memory (`lathe.train.offload.activations_on_host`). `mtp` (verl's `model.mtp.enable_train`): the policy's
        multi-token-prediction layers learn beside the RL loss (`lathe.train.mtp`; the forward then runs packed)."""
        self.model, self.optimizer, self.scheduler, self.cfg = model, optimizer, scheduler, actor_cfg
        self.nonfinite = nonfinite or NonFiniteGuard("actor")
        self.compiled = maybe_compile(model, use_torch_compile(actor_cfg) and tp is None)
        self.use_remove_padding = use_remove_padding
        self.mini_batch_size = mini_batch_size
        self.micro_batch_size = actor_cfg.ppo_micro_batch_size_per_gpu or self.mini_batch_size
        self.sp = sp
        self.data_group = parallel.data_group(sp, tp)
        self.max_token_len, self.max_token_key = group_budget(
            actor_cfg.ppo_max_token_len_per_gpu if actor_cfg.use_dynamic_bsz else None,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", sp)
        self.temperature = temperature
        bypass = bool(rollout_correction and rollout_correction.get("bypass_mode"))
        self.loss_params = policy_loss_params(actor_cfg, rollout_correction if bypass else None)
        self.policy_loss = get_policy_loss("bypass_mode" if bypass else actor_cfg.policy_loss.loss_mode)
        self.correction = rollout_correction if in_update(rollout_correction) else None
        self.loss_scale_factor = actor_cfg.loss_scale_factor or max_response_length   # seq-mean-token-sum-norm's divisor
        self.router_aux_coef = router_aux_loss_coef(model)     # 0 unless a MoE policy's config asks (module doc)
        self.megatron_router = megatron_router_coefs(model, actor_cfg.moe_aux_loss_coeff,   # None: both 0
                                                     actor_cfg.moe_z_loss_coeff)
        self.distillation = distillation
        self.offload_activations = offload_activations
        self.mtp = mtp
        self._mtp_counts: torch.Tensor | None = None      # the mini-batch's MTP-loss tokens per layer

    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches; returns verl's `actor/*` metrics averaged over mini-batches.

        A batch without `old_log_probs` is on-policy: one epoch over one mini-batch, where pi_old is the policy
        being updated, so its log-probs are taken from this update's own forward (detached; verl's `on_policy`
        rule) and the old-policy forward is saved (`lathe.loop.ppo.needs_old_forward`). The engine-vs-trainer check
        `training/rollout_probs_diff_*` is then computed here, over the whole batch (every rank's share)."""
        if "old_log_probs" not in batch and (self.cfg.ppo_epochs != 1 or len(batch) > self.mini_batch_size):
            raise ValueError(f"update_policy: the batch has no old_log_probs, which only an on-policy update (one "
                             f"epoch over one mini-batch) can do without; ppo_epochs={self.cfg.ppo_epochs}, "
                             f"{len(batch)} sequences in mini-batches of {self.mini_batch_size}")
        self.model.train()
        shuffle = (EpochShuffle(self.cfg.data_loader_seed, self.scheduler.last_epoch, self.cfg.use_prefix_grouper)
                   if self.cfg.shuffle else None)
        out = run_ppo_epochs(batch, epochs=self.cfg.ppo_epochs, mini_batch_size=self.mini_batch_size,
                             update_mini_batch=self._update_mini_batch, shuffle=shuffle)
        self.scheduler.step()
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _update_mini_batch(self, mini: Batch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch (all of it in one process): losses normalised by
        the whole mini-batch's token and sequence counts, so gradients summed over ranks and micro-batches are
        those of the mini-batch, however it was cut."""
        self.optimizer.zero_grad(set_to_none=True)
        tokens, seqs = parallel.global_counts(mini["response_mask"], self.data_group, rows=real_rows(mini))
        agg = dict(global_num_tokens=tokens, global_num_seqs=seqs, loss_scale_factor=self.loss_scale_factor)
        if self.mtp is not None:
            self._mtp_counts = token_counts(mini, self.mtp, self.data_group)
        # metrics stay on the device until the mini-batch ends: a host read per micro-batch would make the host
        # wait for each backward before it could queue the next micro-batch
        sums: dict[str, float | torch.Tensor] = defaultdict(float)
        extremes: dict[str, torch.Tensor] = {}
        if self.correction is not None and "old_log_probs" not in mini and "rollout_log_probs" not in mini:
            raise ValueError("update_policy: algorithm.rollout_correction is on and the batch has neither "
                             "old_log_probs nor the engine's rollout_log_probs to correct against")
        own_old = "old_log_probs" not in mini and "rollout_log_probs" in mini    # on-policy: pi_old's are ours
        diff = ProbsDiffSums() if own_old else None
        pieces = CorrectionPieces(self.correction) if own_old and self.correction is not None else None
        replay = ReplayStats() if ROUTED in mini else None                   # routing replay (R2/R3)
        micros = [m for m, _ in micro_batches(mini, size=self.micro_batch_size, max_tokens=self.max_token_len,
                                              key=self.max_token_key, grouped=self.cfg.use_prefix_grouper)]
        for micro in accumulating(self.model, micros):     # one FSDP2 gather a mini-batch where it fits
            with replay_or_nothing(self.model, micro, self.use_remove_padding, replay, self.sp,
                                   self.cfg.use_prefix_grouper):
                with activations_on_host(self.offload_activations) as moved:
                    loss, parts = self._micro_batch_loss(micro, agg, diff, pieces)
                loss.backward()
            if self.offload_activations:       # what waited in host memory, summed over micro-batches and ranks
                parts[OFFLOADED] = moved["bytes"] / 2**30
            weight = real_rows(micro) / seqs   # per-micro metrics (fractions, means) weighted by rows
            for k, v in parts.items():
                v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
                if k in _EXTREMES:
                    extremes[k] = v if k not in extremes else _EXTREMES[k](extremes[k], v)
                else:
                    sums[k] = sums[k] + v * (1.0 if k in _SUMMED or k.startswith(MTP_METRICS) else weight)
        out = parallel.sum_metrics({k: float(v) for k, v in sums.items()}, self.data_group)
        out.update(_over_ranks(extremes, self.data_group))
        if diff is not None:
            reduce = functools.partial(parallel.all_reduce, group=self.data_group)
            out.update({f"training/rollout_probs_diff_{k}": v for k, v in diff.metrics(reduce).items()})
        if pieces is not None:
            out.update(pieces.metrics(functools.partial(parallel.gather_objects, group=self.data_group)))
        if replay is not None:
            counts = parallel.sum_metrics(replay_counts(replay, self.sp), self.data_group)
            out["actor/routing_replay_changed"] = counts["changed"] / max(1.0, counts["given"])
        out["actor/grad_norm"] = clipped_step(self.model, self.optimizer, self.cfg.grad_clip)
        out["actor/skipped_updates"] = self.nonfinite.check(out["actor/grad_norm"], mini)
        return out

    def _micro_batch_loss(self, micro: Batch, agg: dict, diff: ProbsDiffSums | None = None,
                          pieces: CorrectionPieces | None = None) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        mask = micro["response_mask"]
        z_loss = bool(self.megatron_router and self.megatron_router[1])
        with collect_router_stats(self.model, keep_logits=z_loss) if self.router_aux_coef or self.megatron_router \
                else nullcontext() as router:
            if router is not None and not cfg.use_prefix_grouper:      # real tokens of real rows (module doc)
                router.token_index = router_tokens(micro, self.sp)
            stream = [] if self.mtp is not None else None      # the packed forward, for the MTP loss
            log_prob, entropy = response_log_probs(self.model, micro, temperature=self.temperature,
                                                   calculate_entropy=True, remove_padding=self.use_remove_padding,
                                                   prefix_grouper=cfg.use_prefix_grouper, sp=self.sp, keep=stream)
        old = micro.tensors.get("old_log_probs")
        weights = micro.tensors.get("rollout_is_weights")
        if old is None:                     # on-policy (see update_policy): pi_old is this very forward
            old = log_prob.detach()
            if diff is not None:
                diff.add(old, micro["rollout_log_probs"], mask)
            if pieces is not None:          # rollout correction against this forward's pi_old (`in_update`)
                weights = is_weights(old, micro["rollout_log_probs"], mask, pieces.cfg)
                pieces.add(old, micro["rollout_log_probs"], mask)
        pg_loss, pg_metrics = self.policy_loss(
            old, log_prob, micro["advantages"], mask, loss_agg_mode=cfg.loss_agg_mode,
            params=self.loss_params, rollout_is_weights=weights, agg_kwargs=agg)
        if not cfg.entropy_coeff:
            entropy = entropy.detach()   # a zero coefficient adds exact zeros: skip the entropy backward
        entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        parts = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy_loss.detach(),
                 **{k: v for k, v in pg_metrics.items()}}
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = kl_loss.detach()
            parts["actor/kl_coef"] = cfg.kl_loss_coef
        if router is not None and self.router_aux_coef:
            aux = router.aux_loss(None if self.sp is None else ulysses.router_totals(router, self.sp))
            loss = loss + self.router_aux_coef * aux * (real_rows(micro) / agg["global_num_seqs"])
            parts["actor/router_aux_loss"] = aux.detach()
        if router is not None and self.megatron_router:
            layers = None if self.sp is None else ulysses.router_layer_totals(router, self.sp)
            balance, z = router.megatron_losses(layers)
            (c_aux, c_z), layers = self.megatron_router, max(1, len(router.layer_rows))
            loss = loss + (c_aux * balance + c_z * z) * (real_rows(micro) / agg["global_num_seqs"])
            parts.update({"actor/load_balancing_loss": balance.detach() / layers, "actor/z_loss": z.detach() / layers})
        if self.mtp is not None:
            extra, mtp_parts = mtp_loss(self.model, micro, stream[0], self._mtp_counts, self.mtp)
            loss = loss + extra
            parts.update(mtp_parts)
        if self.distillation is not None:
            token_losses, topk_metrics = self._topk_losses(micro) if self.distillation.use_topk else (None, {})
            distill, distill_metrics = distillation_loss(
                log_prob, old, micro.tensors.get("teacher_log_probs"), mask, self.distillation,
                loss_agg_mode=cfg.loss_agg_mode, agg_kwargs=agg, rollout_is_weights=weights,
                token_losses=token_losses)
            loss = combine_losses(loss, distill, self.distillation)
            parts.update(distill_metrics, **topk_metrics, **{"distillation/loss": distill.detach()})
        return loss, parts

    def _topk_losses(self, micro: Batch) -> tuple[torch.Tensor, dict]:
        """The top-k forward KL per token: the student's log-probs of the teacher's top-k tokens (a second pass over
        the micro-batch's final hidden states, `lathe.train.topk`) against the teacher's."""
        student, own = student_topk_log_probs(self.model, micro, micro["teacher_topk_ids"], temperature=self.temperature,
                                              remove_padding=self.use_remove_padding)
        return topk_losses(student, micro["teacher_topk_log_probs"], micro["teacher_topk_ids"], own,
                           micro["response_mask"], self.distillation)


def use_torch_compile(cfg) -> bool:
    """verl's switch for an actor/ref/critic(.model) group: its own `use_torch_compile` (the legacy dp workers'
    key) and its `fsdp_config.use_torch_compile` (the engine workers' key); absent keys count as on. Under expert
    parallelism (`fsdp_config.expert_parallel_size` > 1) the model runs eager, as under tensor parallelism."""
    own = getattr(cfg, "use_torch_compile", True)
    fsdp = getattr(getattr(cfg, "fsdp_config", None), "use_torch_compile", True)
    ep = getattr(getattr(cfg, "fsdp_config", None), "expert_parallel_size", 1)
    return (True if own is None else bool(own)) and (True if fsdp is None else bool(fsdp)) and ep <= 1


# Losses normalised by global mini-batch counts add up over micro-batches; every other metric is averaged.
OFFLOADED = "perf/activation_offload_gb"      # model.enable_activation_offload: GiB an optimizer step offloaded
_SUMMED = {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "distillation/loss", OFFLOADED}
# verl's per-token extremes: the smallest / largest over every micro-batch and rank
_EXTREMES = {f"distillation/{k}_{m}": f for k in ("loss", "student_mass", "teacher_mass")
             for m, f in (("min", torch.minimum), ("max", torch.maximum))}


def _over_ranks(extremes: dict[str, torch.Tensor], group) -> dict[str, float]:
    """`_EXTREMES` metrics over the data-parallel ranks (a minimum as the negated maximum)."""
    if not extremes:
        return {}
    keys = sorted(extremes)
    signs = [-1.0 if _EXTREMES[k] is torch.minimum else 1.0 for k in keys]
    values = parallel.all_reduce([s * float(extremes[k]) for k, s in zip(keys, signs)], op="max", group=group)
    return {k: s * float(v) for k, s, v in zip(keys, signs, values.tolist())}

