"""`lathe sft`: supervised fine-tuning with verl's SFT trainer keys and metric names.

Data (`lathe.data.sft`) is validated and tokenized before a model loads; the model trains in `SFTWorker`s (one
in this process, or one per device as a Ray worker group of FSDP2 ranks when `trainer.nnodes x
trainer.n_gpus_per_node` > 1). Each step takes `data.train_batch_size` examples and makes one optimizer step on
the mean loss over their trained tokens. Metrics: verl's `train/loss`, `train/grad_norm`, `train/lr`,
`train/global_tokens`, `train/total_tokens(B)`, `val/loss` (every `trainer.test_freq` steps and at the last),
plus `timing_s/step` and `perf/throughput`. Checkpoints (`trainer.save_freq`, and the last step) have the layout of
`lathe train`'s: `global_step_N/actor/huggingface` is a Hugging Face model directory that `lathe train` starts
from (`actor_rollout_ref.model.path=...`) and `lathe export` reads; a run resumes exactly where it stopped.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lathe.batch import Batch
from lathe.ckpt.checkpoint import find_resume_dir, load_trainer_state, restore_rng, save_checkpoint
from lathe.config import to_dict, to_yaml
from lathe.config.plan import trainer_devices
from lathe.data import StatefulDataLoader
from lathe.data.errors import DataError
from lathe.data.sft import SFTDataset
from lathe.device import empty_cache, use_cpu_threads
from lathe.loop.preflight import preflight_sft
from lathe.loop.setup import CONFIG_FILE, resolve_device
from lathe.models.hf import import_external_libs, load_policy, load_tokenizer
from lathe.seeding import seed_everything
from lathe.track import Progress, Tracker, brief, phase
from lathe.train.optim import check_optimizer
from lathe.train.sft import sft_batch
from lathe.workers.sft import SFTWorker

log = logging.getLogger("lathe")


def collate(examples, pad_id: int) -> Batch:
    return sft_batch([e.prompt_ids for e in examples], [e.response_ids for e in examples], pad_id,
                     loss_masks=[e.loss_mask for e in examples])


@dataclass
class SFTRun:
    cfg: object
    tokenizer: object
    worker: object                     # SFTWorker, or the Ray group's SFTGroup
    loader: StatefulDataLoader
    val: SFTDataset | None
    tracker: Tracker
    total_steps: int
    world: int
    cluster: object | None = None
    global_step: int = 0
    total_tokens: int = 0

    def every(self, freq: int | str) -> int:
        """A save or validation frequency in steps: verl's `after_each_epoch` is an epoch's steps."""
        return len(self.loader) if freq == "after_each_epoch" else freq

    def close(self) -> None:
        try:
            self.tracker.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()


def build_sft(cfg, *, checked: bool = False) -> SFTRun:
    """The SFT run of `cfg`; `checked`: the caller ran `preflight_sft(cfg)` (else it runs here)."""
    d, m, t = cfg.data, cfg.model, cfg.trainer
    if not checked:
        preflight_sft(cfg)
    device = resolve_device(t.device)
    check_optimizer(cfg.optim, m.fsdp_config, device, key="optim", fsdp_key="model.fsdp_config",
                    sharded=trainer_devices(cfg) > 1 or os.environ.get("LATHE_RAY") == "1")
    seed_everything(t.seed)
    resume_dir = find_resume_dir(t)
    run_dir = Path(t.default_local_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    import_external_libs({"model.external_lib": m.external_lib})
    tokenizer = load_tokenizer(m.tokenizer_path or m.path, chat_template=d.chat_template,
                               trust_remote_code=m.trust_remote_code)
    train = SFTDataset(d.train_files, tokenizer, d, split="train", max_samples=d.train_max_samples)
    val = (SFTDataset(d.val_files, tokenizer, d, split="test", max_samples=d.val_max_samples)
           if d.val_files else None)
    if len(train) < d.train_batch_size:
        raise DataError(f"data.train_files has {len(train)} examples, fewer than data.train_batch_size="
                        f"{d.train_batch_size}: not one step. Fix: lower data.train_batch_size or add data.")
    loader = StatefulDataLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
    total_steps = t.total_training_steps or len(loader) * t.total_epochs
    world = trainer_devices(cfg)
    log.info("sft: %d training examples (%d truncated), %s validation; %d steps of %d", len(train),
             train.num_truncated, len(val) if val is not None else "no", total_steps, d.train_batch_size)
    # (text examples: a Qwen3.5 vision-language checkpoint's language model trains alone, saved whole: load_policy)
    load_kwargs = dict(impl=m.impl, trust_remote_code=m.trust_remote_code, vocab_size=len(tokenizer), seed=t.seed,
                       override_config=m.override_config, vision=False)
    cluster = None
    if world > 1 or os.environ.get("LATHE_RAY") == "1":
        from lathe.cluster import start_sft_cluster
        cluster = start_sft_cluster(cfg, model_path=m.path, load_kwargs=load_kwargs, tokenizer=tokenizer,
                                    total_steps=total_steps, device_type=device.type)
        worker = cluster.actor
    else:
        worker = SFTWorker(cfg, use_cpu_threads(load_policy(m.path, **load_kwargs), device), tokenizer,
                           total_steps=total_steps, device=device)
    run = SFTRun(cfg=cfg, tokenizer=tokenizer, worker=worker, loader=loader, val=val, cluster=cluster,
                 tracker=Tracker(t.logger, run_dir, project=t.project_name, experiment=t.experiment_name,
                                 config=to_dict(cfg), total_steps=total_steps),
                 total_steps=total_steps, world=world)
    if resume_dir is not None:
        try:
            worker.load_checkpoint(resume_dir / "actor")
            state = load_trainer_state(resume_dir)
            loader.load_state_dict(state["loader"])
            restore_rng(state["rng"])
            run.global_step, run.total_tokens = state["global_step"], int(state["total_tokens"])
            log.info("sft: resumed from %s (step %d)", resume_dir, run.global_step)
        except BaseException:
            run.close()
            raise
    run.tracker.truncate_after(run.global_step)
    if device.type == "cuda":
        empty_cache(device)
    return run


def validation_loss(run: SFTRun) -> float:
    """Mean NLL per trained token over the validation set (all of it in one process; whole rounds of the devices
    on many)."""
    d, pad = run.cfg.data, run.tokenizer.pad_token_id
    size = d.micro_batch_size_per_gpu * run.world
    rows = len(run.val) - len(run.val) % run.world
    nll = tokens = 0.0
    with phase(f"validating on {rows} examples", done=f"validated on {rows} examples"):
        for start in range(0, rows, size):
            examples = [run.val[i] for i in range(start, min(start + size, rows))]
            out = run.worker.eval_loss(collate(examples, pad))
            nll, tokens = nll + out["nll"], tokens + out["tokens"]
    return nll / max(tokens, 1.0)


def fit_sft(run: SFTRun) -> dict[str, float]:
    t, pad = run.cfg.trainer, run.tokenizer.pad_token_id
    last: dict[str, float] = {}
    with Progress("sft", run.total_steps, initial=run.global_step, every_s=None) as bar:   # a terminal's live line
        while run.global_step < run.total_steps:
            last = sft_step(run, pad)
            bar.update(run.global_step, brief(last))
            done = run.global_step >= run.total_steps
            if done or (run.every(t.save_freq) > 0 and run.global_step % run.every(t.save_freq) == 0):
                path = save_checkpoint(Path(t.default_local_dir).expanduser(), run.global_step, {"actor": run.worker},
                                       {"loader": run.loader.state_dict(), "total_tokens": run.total_tokens},
                                       max_to_keep=t.max_ckpt_to_keep)
                if done:
                    log.info("sft: %s is a Hugging Face model (lathe train's actor_rollout_ref.model.path)",
                             path / "actor" / "huggingface")
    return last


def sft_step(run: SFTRun, pad: int) -> dict[str, float]:
    """One optimizer step on the next batch, validated when due; returns (and logs) its metrics."""
    t = run.cfg.trainer
    start = time.perf_counter()
    batch = collate(run.loader.next_batch(), pad)
    run.global_step += 1
    metrics = run.worker.train_step(batch)
    tokens = int(batch["attention_mask"].sum())
    run.total_tokens += tokens
    seconds = time.perf_counter() - start
    metrics.update({"train/global_tokens": tokens, "train/total_tokens(B)": run.total_tokens / 1e9,
                    "timing_s/step": seconds, "perf/throughput": tokens / max(seconds, 1e-9) / run.world})
    done = run.global_step >= run.total_steps
    if run.val is not None and (done or (run.every(t.test_freq) > 0 and run.global_step % run.every(t.test_freq) == 0)):
        metrics["val/loss"] = validation_loss(run)
    run.tracker.log(metrics, step=run.global_step)
    return metrics


def run_sft(cfg, *, checked: bool = False) -> dict[str, float]:
    run = build_sft(cfg, checked=checked)
    try:
        return fit_sft(run)
    finally:
        run.close()

