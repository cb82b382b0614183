"""Pieces every PPO-style learner shares: the epoch/mini-batch loop, the clipped optimizer step, and
saving/loading a module with its optimizer and scheduler."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lathe.batch import GHOST, Batch
from lathe.ckpt import manifest
from lathe.train import parallel
from lathe.train.optim import check_optimizer_class, optimizer_name

log = logging.getLogger("lathe")


@dataclass(frozen=True)
class EpochShuffle:
    """verl's actor/critic `shuffle`: each PPO epoch takes the rows in a fresh random order before they are cut into
    mini-batches, so a row meets other rows in each epoch's mini-batches. The order is drawn from (`seed`, `update`,
    epoch) alone (`data_loader_seed`, the optimizer's update count, the epoch): every rank of a sequence- or
    tensor-parallel group draws the same, and a resumed run the same as an uninterrupted one. `by_prompt` moves a
    prompt's rows (`uid`) as one unit, in their order, so that `use_prefix_grouper` still finds them side by side;
    a ghost row (`lathe.cluster.dispatch`) is a unit of its own. Each rank orders its own share (as verl's workers
    do), so a run on several ranks draws other mini-batches than one process does."""

    seed: int
    update: int
    by_prompt: bool = False

    def order(self, batch: Batch, epoch: int) -> list[int]:
        """A permutation of `batch`'s rows for `epoch`."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed % 2**64, self.update, epoch]))
        if not self.by_prompt or "uid" not in batch:
            return rng.permutation(len(batch)).tolist()
        ghost = batch[GHOST].tolist() if GHOST in batch else [False] * len(batch)
        units = [("ghost", i) if g else ("uid", u) for i, (u, g) in enumerate(zip(batch["uid"], ghost))]
        distinct = list(dict.fromkeys(units))
        place = {distinct[j]: at for at, j in enumerate(rng.permutation(len(distinct)).tolist())}
        return sorted(range(len(batch)), key=lambda i: (place[units[i]], i))


def run_ppo_epochs(batch: Batch, *, epochs: int, mini_batch_size: int,
                   update_mini_batch: Callable[[Batch], dict[str, float]],
                   shuffle: EpochShuffle | None = None) -> dict[str, float]:
    """`epochs` passes over `batch` in mini-batches; each mini-batch's metrics averaged over all of them. With
    `shuffle`, each pass over more than one mini-batch takes the rows in its own order (`EpochShuffle`)."""
    metrics: dict[str, list[float]] = defaultdict(list)
    for epoch in range(epochs):
        rows = batch if shuffle is None or len(batch) <= mini_batch_size else batch.select(shuffle.order(batch, epoch))
        for mini in rows.split(mini_batch_size):
            for k, v in update_mini_batch(mini).items():
                metrics[k].append(v)
    return {k: sum(v) / len(v) for k, v in metrics.items()}


class NonFiniteUpdates(RuntimeError):
    """Several updates in a row had a non-finite gradient norm (each was skipped)."""


class NonFiniteGuard:
    """Watches each optimizer step's gradient norm: a non-finite one means the update was skipped (`clipped_step`
    drops that gradient); it is counted, its mini-batch is saved to `dump_dir` for a post-mortem, and `limit`
    skipped updates in a row (0: never) stop the run."""

    def __init__(self, what: str, limit: int = 3, dump_dir: Path | None = None):
        self.what, self.limit, self.dump_dir = what, int(limit), dump_dir
        self.in_a_row = self.total = 0

    def check(self, grad_norm: float, mini: Batch) -> float:
        """1.0 when this update was skipped, else 0.0 (its mean over a step is the share skipped)."""
        if math.isfinite(grad_norm):
            self.in_a_row = 0
            return 0.0
        self.in_a_row += 1
        self.total += 1
        saved = ""
        if self.dump_dir is not None and parallel.rank() == 0:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            file = self.dump_dir / f"{self.what}_skip{self.total}.pt"
            torch.save({k: v.detach().cpu() for k, v in mini.tensors.items()}, file)
            saved = f"; its mini-batch is in {file}"
        log.warning("%s: gradient norm %s, update skipped (%d in a row)%s", self.what, grad_norm, self.in_a_row, saved)
        if 0 < self.limit <= self.in_a_row:
            raise NonFiniteUpdates(
                f"{self.what}: {self.in_a_row} updates in a row had a non-finite gradient norm ({grad_norm}) and were "
                f"skipped{saved}. Something upstream is inf/NaN or diverging: check the rewards and advantages of "
                "those batches, lower the learning rate, or set grad_clip; trainer.max_nonfinite_updates (0 = never "
                "stop) sets how many in a row end the run.")
        return 1.0


def nonfinite_guard(cfg, what: str) -> NonFiniteGuard:
    """The guard of a run: `trainer.max_nonfinite_updates`, skipped batches under the run directory."""
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    return NonFiniteGuard(what, cfg.trainer.max_nonfinite_updates, run_dir / "nonfinite_batches")


def clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the gradient norm, step the optimizer unless the norm is not finite, then free the gradients.

    An optimizer that keeps its own gradients (`MasterAdamW`: fp32 buffers beside bf16 parameters) clips them.
    The gradients are freed at once rather than at the next mini-batch: after the last step of an update they
    would otherwise stay through the next rollout (a full fp32 copy of the model: 28 GiB at 7B, taken from the
    engine's KV cache)."""
    own = getattr(optimizer, "clip_grad_norm_", None)
    grad_norm = own(grad_clip) if own is not None else parallel.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = parallel.to_local(grad_norm)          # sharded parameters: the norm over all shards
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


SHARDED = "sharded"        # torch.distributed.checkpoint's directory: weights and optimizer state, one file per rank
def save_trainable(path: Path, model, optimizer, scheduler) -> None:
    """HF-format weights under `path/huggingface` (transformers loads them) plus `path/optim.pt`.

    The weights saved are those the optimizer updates: the fp32 masters of a mixed-precision model, so that a
    resumed run continues from exactly the same numbers. A plain optimizer's state is saved by parameter name
    (`torch.distributed.checkpoint.state_dict`'s full form), so a one-device checkpoint resumes on any number
    of ranks. Ranks of a group (every rank calls this) save weights and optimizer state sharded under
    `path/sharded` (`torch.distributed.checkpoint`: each rank writes its own shards, no rank holds the whole
    optimizer state), which loads on any number of ranks, one process included; rank 0 also gathers the weights
    for `path/huggingface`."""
    masters = getattr(optimizer, "master_state_dict", None)
    if parallel.in_group():                      # sharded: each rank writes its shards, rank 0 the HF weights
        state, optim = parallel.full_state(model), None
        parallel.save_sharded(path / SHARDED, model, optimizer)
    elif masters is not None:                    # MasterAdamW: one device, its own state format
        state, optim = masters(model), optimizer.state_dict()
    else:
        state, optim = parallel.full_state(model), parallel.full_optimizer_state(model, optimizer)
    if parallel.rank() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "huggingface", safe_serialization=True, state_dict=state)
    manifest.save_hashed({"optimizer": optim, "scheduler": scheduler.state_dict(), "by_name": masters is None,
                          "sharded": optim is None, "optimizer_class": optimizer_name(optimizer)}, path / "optim.pt",
                         written=sorted((path / "huggingface").glob("*.safetensors")))


def save_model_checkpoint(path: Path, model, optimizer, scheduler, *, base_model: str | None) -> None:
    """A trained model's checkpoint (the actor's, the critic's, `lathe sft`'s): `lathe.train.lora.save_lora` for a
    LoRA model, else `save_trainable`."""
    from lathe.models.lora import has_lora
    from lathe.train.lora import save_lora
    if has_lora(model):
        save_lora(path, model, optimizer, scheduler, base_model=base_model)
    else:
        save_trainable(path, model, optimizer, scheduler)


def save_policy_checkpoint(path: Path, model, optimizer, scheduler, tokenizer, *,
                           base_model: str | None) -> None:
    """`save_model_checkpoint`; rank 0 adds the tokenizer to `huggingface/`."""
    save_model_checkpoint(path, model, optimizer, scheduler, base_model=base_model)
    if parallel.rank() == 0:
        tokenizer.save_pretrained(path / "huggingface")


def load_policy_checkpoint(path: Path, model, optimizer, scheduler, *, what: str) -> None:
    """Restore what `save_model_checkpoint` wrote (the actor's, the critic's, `lathe sft`'s; a tied
    `lm_head.weight` is not expected in the files)."""
    from lathe.models.lora import has_lora
    from lathe.train.lora import LORA_ADAPTER, load_lora
    if has_lora(model):
        load_lora(path, model, optimizer, scheduler, what=what)
        return
    if (path / LORA_ADAPTER).is_dir():          # a LoRA run's: its optimizer state is the adapters'
        raise ValueError(f"{what} checkpoint {path} was saved by a run with LoRA ({LORA_ADAPTER}/), but this run "
                         f"trains the {what} without it. Fix: resume with the same lora_rank as that run, or start a "
                         f"new run from its merged weights (model.path={path / 'huggingface'}).")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    load_trainable(path, model, optimizer, scheduler, what=what,
                   ignore_missing=lambda name: tied and name == "lm_head.weight")


def load_trainable(path: Path, model, optimizer, scheduler, *, what: str,
                   ignore_missing: Callable[[str], bool] = lambda name: False) -> None:
    """Restore what `save_trainable` wrote; weights that do not fit the model raise, naming the tensors.
    Sharded models: every rank calls this with the same path."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from lathe.models.io import module_layout, module_names, unrun_mtp
    files = sorted((path / "huggingface").glob("*.safetensors"))
    if not files or not (path / "optim.pt").exists():
        raise FileNotFoundError(f"{what} checkpoint {path} is incomplete: expected huggingface/*.safetensors and "
                                "optim.pt")
    saved: set[str] = set()
    for f in files:                              # names from the headers: the tensors are read only when used
        with safe_open(f, framework="pt") as handle:
            saved.update(handle.keys())
    config = getattr(model, "config", None)
    saved = {n for n in saved if not unrun_mtp(n, config)}     # MTP layers copied from model.path (mtp.enable)
    saved = module_names(saved, config)         # a MoE model's experts: one tensor per expert on disk
    text_of_vl = getattr(config, "vl_checkpoint", None) is not None
    if text_of_vl:                               # a VL checkpoint's language model alone: the whole model saved
        from lathe.models.vl.io import language_model_names
        saved = language_model_names(saved)
    names = set(model.state_dict().keys())
    missing = [m for m in sorted(names - saved) if not ignore_missing(m)]
    unexpected = sorted(saved - names)
    if missing or unexpected:
        raise RuntimeError(f"{what} checkpoint {path} does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    opt = torch.load(path / "optim.pt", weights_only=True)
    check_optimizer_class(opt, optimizer, path, what)
    optimizer.state.clear()     # the fresh zero moments (`optim.materialize_state`) go before the saved ones come
    load_masters = getattr(optimizer, "load_master_state_dict", None)
    if opt.get("sharded") and load_masters is None:       # any number of ranks, one process included
        parallel.load_sharded(path / SHARDED, model, optimizer)   # each rank reads its own shards only
        scheduler.load_state_dict(opt["scheduler"])
        return
    state = {}
    for f in files:
        state.update(load_file(f))
    state = module_layout({k: v for k, v in state.items() if not unrun_mtp(k, config)}, config)
    if text_of_vl:
        from lathe.models.vl.io import language_model_state
        state = language_model_state(state)
    if load_masters is not None:
        if opt.get("by_name"):
            raise RuntimeError(f"{what} checkpoint {path} was written by a run without fp32 master weights (CPU or "
                               "several devices); resume it with the same device type and precision")
        model.load_state_dict(state, strict=False)
        load_masters(model, state)
        optimizer.load_state_dict(opt["optimizer"])
    elif opt.get("by_name"):
        parallel.load_full_state(model, optimizer, state, opt["optimizer"], ignore_missing=ignore_missing)
    elif parallel.in_group():
        raise RuntimeError(f"{what} checkpoint {path} holds an optimizer state saved by an older lathe on one "
                           "device; resume it on one device (trainer.n_gpus_per_node=1 trainer.nnodes=1) and save "
                           "again, which writes the state by parameter name")
    else:
        model.load_state_dict(state, strict=False)
        optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
