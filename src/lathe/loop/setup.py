"""Build everything a run needs from its config, cheapest and most error-prone checks first.

Order: the pre-flight checks (`lathe.loop.preflight`: model paths, data files and columns, scorers, the reward
function), algorithm names, data (rows, lengths), resume point — all before a model loads — then model (and warm
start), workers, tracker, and finally the resumed state.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lathe.algo import KL_PENALTIES, get_adv_estimator, get_policy_loss, make_kl_controller
from lathe.batch import Batch
from lathe.ckpt.checkpoint import find_resume_dir, load_trainer_state, restore_rng
from lathe.config import LatheConfig, RunPlan, critic_in_use, run_plan, to_dict, to_yaml
from lathe.config.verl_translate import dist_checkpoint, dist_checkpoint_prefix
from lathe.data import RLDataset, StatefulDataLoader
from lathe.data.custom import custom_source
from lathe.data.dataset import REWARD_SOURCE, reward_source
from lathe.data.errors import DataError
from lathe.data.multimodal import multimodal_non_tensors
from lathe.device import default_device_type, device_count, empty_cache, use_cpu_threads
from lathe.generation import SamplingParams
from lathe.loop import warm_cache
from lathe.loop.preflight import Checked, preflight
from lathe.loop.warm_start import warm_start, warm_start_examples
from lathe.models.hf import import_external_libs, is_vl_path, load_policy, load_tokenizer
from lathe.config.rules_reward import is_batch_manager
from lathe.reward import BatchRewardManager, RewardManager
from lathe.reward.registry import scorer_for
from lathe.reward.sandbox import configure as configure_sandbox
from lathe.rollout.agent import load_run_tools
from lathe.track import Tracker, phase
from lathe.track.energy import DeviceEnergy, for_cluster
from lathe.train.fp8 import check_device as check_fp8_device
from lathe.train.optim import check_optimizer
from lathe.seeding import seed_everything
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker
from lathe.workers.critic import CriticWorker
from lathe.workers.build import build_reward_model
from lathe.workers.judge import JudgeWorker
from lathe.workers.reward_model import RewardModelWorker

log = logging.getLogger("lathe")
CONFIG_FILE = "config.yaml"   # the resolved config, written into the run directory at start
INIT_MODEL = "init_model"   # the warm-started starting point, kept in the run directory for resume and reference


@dataclass
class Trainer:
    cfg: LatheConfig
    plan: RunPlan                       # what the config implies (devices, batch cut, async): lathe.config.plan
    tokenizer: object
    worker: ActorRolloutRefWorker       # or the cluster's group with the same methods
    reward: RewardManager
    loader: StatefulDataLoader
    val_dataset: RLDataset | None
    tracker: Tracker
    sampling: SamplingParams
    val_sampling: SamplingParams
    kl_ctrl: object
    total_steps: int
    device: torch.device
    critic: CriticWorker | None = None  # when a critic trains (algorithm.adv_estimator=gae); or its group
    # reward_model.enable: scores the responses (a classifier or a generative judge); or its Ray group
    reward_model: RewardModelWorker | JudgeWorker | None = None
    cluster: object | None = None       # the Ray worker groups behind worker/critic on many devices
    global_step: int = 0
    resumed_from: Path | None = None
    resume_state: dict | None = None    # the trainer_state of the checkpoint resumed from
    energy: DeviceEnergy | None = None  # the device's energy per phase (perf/energy_j/*), where NVML reads it

    def close(self) -> None:
        """Flush the loggers, stop the reward processes and the workers."""
        try:
            self.tracker.close()
            self.reward.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def next_rows(self) -> list[dict]:
        """The next dataloader batch, starting a new epoch when one runs out."""
        return self.loader.next_batch()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = default_device_type()
    elif name != "cpu" and device_count(name) == 0:
        raise RuntimeError(f"trainer.device={name} but no {name} device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def check_algorithm_names(cfg) -> None:
    """Unknown estimator / loss / KL names fail here, listing the known ones."""
    get_adv_estimator(cfg.algorithm.adv_estimator)
    get_policy_loss(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
    for key, name in (("actor_rollout_ref.actor.kl_loss_type", cfg.actor_rollout_ref.actor.kl_loss_type),
                      ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        if name not in KL_PENALTIES:
            raise ValueError(f"{key}={name!r} is not a KL estimator; known: {', '.join(KL_PENALTIES)}")


def check_optimizers(cfg, plan: RunPlan, device: torch.device) -> None:
    """The actor's optimizer (and the critic's): its class, arguments and offload, as the workers will build it."""
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    groups = [("actor_rollout_ref.actor", a.optim, a.fsdp_config, "actor_rollout_ref.actor.fsdp_config")]
    if plan.critic is not None:
        groups.append(("critic", c.optim, c.model.fsdp_config, "critic.model.fsdp_config"))
    for role, optim, fsdp, fsdp_key in groups:
        check_optimizer(optim, fsdp, device, key=f"{role}.optim", fsdp_key=fsdp_key, sharded=uses_ray(plan))


def external_libs(cfg) -> dict[str, str | None]:
    """verl's `external_lib` modules to import before any model loads (the critic's when it trains)."""
    libs = {"actor_rollout_ref.model.external_lib": cfg.actor_rollout_ref.model.external_lib}
    if critic_in_use(cfg):
        libs["critic.model.external_lib"] = cfg.critic.model.external_lib
    return libs


def sampling_params(rollout_cfg, max_tokens: int, *, validation: bool = False) -> SamplingParams:
    src = rollout_cfg.val_kwargs if validation else rollout_cfg
    return SamplingParams(n=src.n, temperature=src.temperature, top_p=src.top_p, top_k=src.top_k,
                          do_sample=src.do_sample, max_tokens=max_tokens, ignore_eos=rollout_cfg.ignore_eos)


def load_vl_processor(cfg) -> tuple[Any, str | None]:
    """(processor, why not): the image processor of a vision-language policy (`lathe.data.multimodal.load_processor`
    of `model.tokenizer_path` or `model.path`), or None for a text model: image rows then fail in `RLDataset`,
    naming the column. A VL checkpoint whose processor cannot be loaded (a `tokenizer_path` with a tokenizer
    alone) gives None and the loader's error: text-only data runs its language model alone and needs none; the
    first image row fails with that error."""
    m = cfg.actor_rollout_ref.model
    if not is_vl_path(m.path):
        return None, None
    from lathe.data.multimodal import load_processor
    try:
        return load_processor(os.path.expanduser(str(m.tokenizer_path or m.path))), None
    except DataError as err:
        return None, str(err)


def load_datasets(cfg, tokenizer, processor=None, processor_error: str | None = None
                  ) -> tuple[RLDataset, RLDataset | None]:
    """(train, val) datasets of `data.*`; `processor` (a VL policy's, see `load_vl_processor`) encodes the
    images of the `data.image_key` column; `processor_error`: why a VL policy has none."""
    d = cfg.data
    template_kwargs = dict(d.apply_chat_template_kwargs)
    tools = load_run_tools(cfg)           # multi-turn: the prompts show the tools (and a bad tool file fails here)
    if tools is not None:
        template_kwargs["tools"] = tools.schemas()
    kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
              filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
              apply_chat_template_kwargs=template_kwargs, processor=processor, processor_error=processor_error,
              image_key=d.image_key,
              reward_fn_key=d.reward_fn_key)     # (data.video_key: another column than verl's is refused)
    def split(files, name: str, max_samples: int) -> RLDataset:
        rows = None
        if d.custom_cls.path:               # a user's dataset class reads the files; its items are the rows
            rows = custom_source(d.custom_cls.path, d.custom_cls.name, files, tokenizer, processor, d, max_samples)
        return RLDataset(files, tokenizer, split=name, max_samples=max_samples, shuffle=d.shuffle, seed=d.seed,
                         rows=rows, **kw)

    train = split(d.train_files, "train", d.train_max_samples)
    val = split(d.val_files, "val", d.val_max_samples) if d.val_files else None
    for name, ds in (("train", train), ("val", val)):
        if ds is not None and ds.num_filtered:
            log.warning("data: %d %s prompts longer than data.max_prompt_length=%d were filtered out (%d remain)",
                        ds.num_filtered, name, d.max_prompt_length, len(ds))
    return train, val


def check_scorers(datasets, custom_path: str | None) -> None:
    """Without a custom reward function every data_source needs a built-in scorer, and code tasks the local
    sandbox: fail before training."""
    if custom_path:
        return
    from lathe.reward import sandbox
    from lathe.reward.code import CODE_SOURCES
    for ds in datasets:
        if ds is not None:
            for source in sorted({reward_source(ds[i]) for i in range(len(ds))}):
                scorer_for(source)
                why = sandbox.unavailable() if source in CODE_SOURCES else None
                if why:
                    raise ValueError(f"data_source={source!r} is a code task, scored by running the responses in "
                                     f"lathe's local sandbox, which cannot run here: {why}.")


def model_source(cfg, tokenizer, run_dir: Path, resume_dir: Path | None, *, vision: bool = True) -> tuple[str, dict]:
    """(path, `load_policy` keywords) of the starting policy: the warm-started copy in `run_dir/init_model` once
    `build_model` wrote it (or a resumed run finds it), else `model.path`. `vision`: whether the run's data has
    images (without, a Qwen3.5 vision-language checkpoint's language model runs alone: `load_policy`)."""
    m = cfg.actor_rollout_ref.model
    init_dir = run_dir / INIT_MODEL
    needs_transformers = cfg.actor_rollout_ref.rollout.name == "hf"
    if (resume_dir is not None or m.warm_start.steps > 0) and (init_dir / "config.json").exists():
        return str(init_dir), dict(impl=m.impl, needs_transformers=needs_transformers, vision=vision)
    return _given_model(cfg, tokenizer, vision)


def _given_model(cfg, tokenizer, vision: bool = True) -> tuple[str, dict]:
    m = cfg.actor_rollout_ref.model
    return m.path, dict(impl=m.impl, needs_transformers=cfg.actor_rollout_ref.rollout.name == "hf", vision=vision,
                        trust_remote_code=m.trust_remote_code, vocab_size=len(tokenizer), seed=cfg.trainer.seed,
                        override_config=hf_overrides(m.override_config), dist_checkpoint=dist_checkpoint(cfg),
                        dist_checkpoint_prefix=dist_checkpoint_prefix(cfg))


def hf_overrides(override_config: dict) -> dict:
    """`model.override_config` without `attn_implementation`, which chooses lathe's attention (the actor applies it:
    `lathe.models.attention.set_attention`) rather than a config value of the checkpoint's."""
    return {k: v for k, v in override_config.items() if k != "attn_implementation"}


def build_model(cfg, tokenizer, train_ds: RLDataset, run_dir: Path, resume_dir: Path | None,
                device: torch.device, *, vision: bool = True):
    """The starting policy: `model.path`, warm-started when asked (saved as `run_dir/init_model`; the same warm
    start again is read from lathe's cache, `loop/warm_cache.py`); `vision`: see `model_source`."""
    ws = cfg.actor_rollout_ref.model.warm_start
    init_dir = run_dir / INIT_MODEL
    if resume_dir is not None and (init_dir / "config.json").exists():
        path, kwargs = model_source(cfg, tokenizer, run_dir, resume_dir, vision=vision)
        return use_cpu_threads(load_policy(path, **kwargs), device)
    path, kwargs = _given_model(cfg, tokenizer, vision)
    if ws.steps <= 0:
        return use_cpu_threads(load_policy(path, **kwargs), device)
    if is_vl_path(path):
        raise NotImplementedError(f"actor_rollout_ref.model.warm_start.steps={ws.steps}: the warm start trains on "
                                  f"text answers only, and {path} is a vision-language model. Fix: set "
                                  "actor_rollout_ref.model.warm_start.steps=0 (name a preset other than `default`, "
                                  "whose built-in demo warm-starts)")
    examples = warm_start_examples(cfg, tokenizer, train_ds)
    key, inputs = warm_cache.warm_start_key(path=path, load_kwargs=kwargs, examples=examples, steps=ws.steps,
                                            lr=ws.lr, batch_size=ws.batch_size, seed=cfg.trainer.seed,
                                            device_type=device.type)
    if ws.cache and warm_cache.fetch(key, init_dir):
        log.info("warm start: %d supervised steps read from the cache (%s; warm_start.cache=false trains again)",
                 ws.steps, warm_cache.cache_root() / "warm_start" / key)
        path, kwargs = model_source(cfg, tokenizer, run_dir, resume_dir, vision=vision)
        return use_cpu_threads(load_policy(path, **kwargs), device)
    model = use_cpu_threads(load_policy(path, **kwargs), device)
    model.to(device)
    warm_start(cfg, model, examples, tokenizer.pad_token_id, device)
    with phase(f"saving the warm-started model to {init_dir}", done=f"saved the warm-started model to {init_dir}"):
        model.save_pretrained(init_dir, safe_serialization=True)
        tokenizer.save_pretrained(init_dir)
    if ws.cache:
        warm_cache.store(key, inputs, init_dir)
    return model


def build_trainer(cfg, checked: Checked | None = None) -> Trainer:
    """The trainer of `cfg`; `checked`: what `preflight(cfg)` returned when the caller ran it (else it runs here)."""
    t = cfg.trainer
    arr = cfg.actor_rollout_ref
    checked = checked or preflight(cfg)
    check_algorithm_names(cfg)
    reward_fn = checked.reward_fn
    sb = cfg.reward_model.sandbox_fusion
    configure_sandbox(max_concurrent=sb.max_concurrent, memory_limit_mb=sb.memory_limit_mb,   # before scorers fork
                      url=sb.url or None)
    plan = run_plan(cfg)
    device = resolve_device(t.device)
    check_fp8_device(arr.actor.fsdp_config.fp8_training, device)     # torchao and an FP8 GPU, before a model loads
    check_optimizers(cfg, plan, device)
    if uses_ray(plan):                  # a placement this machine's Ray cluster cannot hold fails before anything loads
        from lathe.cluster.placement import check_local_fit
        check_local_fit(cfg, plan, device.type, device_count(device.type) if device.type != "cpu" else 0)
    seed_everything(t.seed)
    resume_dir = find_resume_dir(t)
    run_dir = Path(t.default_local_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))        # what ran (lathe report shows it)

    import_external_libs(external_libs(cfg))
    tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path, chat_template=arr.model.custom_chat_template,
                               trust_remote_code=arr.model.trust_remote_code or cfg.data.trust_remote_code)
    train_ds, val_ds = load_datasets(cfg, tokenizer, *load_vl_processor(cfg))
    check_scorers([train_ds, val_ds], cfg.reward.custom_reward_function.path)
    loader = StatefulDataLoader(train_ds, cfg.data.gen_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    total_steps = t.total_training_steps or len(loader) * t.total_epochs
    if plan.is_async:                       # fully async: a step is train_batch_size prompts
        total_steps = _async_steps(cfg, len(loader), total_steps)

    vision = any(ds is not None and ds.has_images for ds in (train_ds, val_ds))    # (see `model_source`)
    model = build_model(cfg, tokenizer, train_ds, run_dir, resume_dir, device, vision=vision)
    check_parallel_model(plan, model, impl=arr.model.impl)
    log_memory_plan(cfg, plan, model, device)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))        # (again: the plan may choose the engine's layout)
    cluster = None
    if uses_ray(plan):                  # Ray workers, each loading the weights
        path, kwargs = model_source(cfg, tokenizer, run_dir, resume_dir, vision=vision)
        del model
        empty_cache(device)
        from lathe.cluster import start_async_cluster, start_cluster
        with phase("starting the Ray workers", done="Ray workers ready"):
            cluster = (start_async_cluster if plan.is_async else start_cluster)(
                cfg, plan, model_path=path, load_kwargs=kwargs, tokenizer=tokenizer, total_steps=total_steps,
                device_type=device.type)
        worker, critic, device = cluster.actor, cluster.critic, torch.device("cpu")   # the driver holds no model
        reward_model = getattr(cluster, "reward_model", None)
    else:
        worker = ActorRolloutRefWorker(cfg, model, tokenizer, plan=plan, total_steps=total_steps, device=device)
        critic = (CriticWorker(cfg, tokenizer, plan=plan.critic, total_steps=total_steps, device=device,
                               mesh=plan.mesh("critic"))
                  if plan.critic is not None else None)
        reward_model = build_reward_model(cfg, plan, tokenizer, device=device) if cfg.reward_model.enable else None
    trainer = Trainer(
        cfg=cfg, plan=plan, tokenizer=tokenizer, worker=worker, cluster=cluster,
        reward=reward_manager(cfg, reward_fn),
        loader=loader, val_dataset=val_ds,
        tracker=Tracker(t.logger, run_dir, project=t.project_name, experiment=t.experiment_name,
                        config=to_dict(cfg), total_steps=total_steps),
        sampling=sampling_params(arr.rollout, cfg.data.max_response_length),
        val_sampling=sampling_params(arr.rollout, cfg.data.max_response_length, validation=True),
        kl_ctrl=make_kl_controller(**vars(cfg.algorithm.kl_ctrl)),
        total_steps=total_steps, device=device, critic=critic, reward_model=reward_model,
        energy=DeviceEnergy.open(device) if cluster is None else for_cluster(cluster.groups))
    if resume_dir is not None:
        try:
            resume(trainer, resume_dir)
        except BaseException:
            trainer.close()
            raise
    trainer.tracker.truncate_after(trainer.global_step)
    return trainer


def reward_manager(cfg, reward_fn) -> RewardManager:
    """`reward_model.reward_manager`'s manager around `reward_fn`: one call per batch (`batch`), else per response."""
    r = cfg.reward
    limits = dict(timeout_s=r.timeout_s, max_failure_fraction=r.max_failure_fraction,
                  max_failing_calls=r.max_failing_calls)
    if is_batch_manager(cfg):
        return BatchRewardManager(reward_fn, **limits)
    return RewardManager(reward_fn, num_workers=r.num_workers, **limits)


def check_parallel_model(plan: RunPlan, model, impl: str = "auto") -> None:
    """A policy that the actor's or reference's Ulysses size cannot split (lathe's text or vision-language model), or
    their tensor-parallel size cannot cut (any but lathe's text decoder, or heads that do not divide), or their
    expert-parallel size cannot place (no experts of lathe's, or experts that do not divide), fails here,
    before the workers start (they check again, after picking their implementation). `model` as the driver loaded
    it: a transformers module (a built-in model, `model.override_config`) that the workers will turn into lathe's
    decoder (`impl` not hf: `select_impl`) is checked as that decoder, sharing its tensors."""
    from lathe.models.decoder import LatheCausalLM
    from lathe.models.vl import LatheVLForConditionalGeneration
    from lathe.train import tensor_parallel
    from lathe.train.ulysses import check_model
    model = _as_workers_run_it(model, impl)
    roles = [("actor", plan.actor.sequence_parallel_size, plan.actor.tensor_parallel_size),
             ("ref", plan.ref_sequence_parallel_size, plan.ref_tensor_parallel_size)][:1 + plan.needs_ref]
    for role, sp, tp in roles:
        tp_key = f"actor_rollout_ref.{role}.fsdp_config.tensor_parallel_size"
        # tensor parallelism: any other model (VL, a transformers fallback) is refused too, by the same check
        tensor_parallel.check_model(model, tp, tp_key, plan.mesh(role).ep)
        if isinstance(model, (LatheCausalLM, LatheVLForConditionalGeneration)):     # beside TP: a rank's heads
            check_model(model, sp, f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size", tp, tp_key)
    # expert parallelism: a dense model, or experts the size does not divide, are refused the same way
    from lathe.train import expert_parallel
    for role in ("actor", "ref")[:1 + plan.needs_ref]:
        expert_parallel.check_model(model, plan.mesh(role).ep,
                                    f"actor_rollout_ref.{role}.fsdp_config.expert_parallel_size")


def _as_workers_run_it(model, impl: str):
    """`model`, or the lathe decoder `select_impl` makes of a transformers module for the workers (its tensors
    shared, nothing copied); the transformers module itself where lathe's decoder does not implement it or
    `impl` is hf."""
    from lathe.models.config import UnsupportedArchitecture
    from lathe.models.decoder import LatheCausalLM, LatheValueModel
    from lathe.models.hf import lathe_from_transformers
    from lathe.models.vl import LatheVLForConditionalGeneration
    if impl == "hf" or isinstance(model, (LatheCausalLM, LatheValueModel, LatheVLForConditionalGeneration)):
        return model
    try:
        return lathe_from_transformers(model, clone=False)
    except UnsupportedArchitecture:
        return model


def uses_ray(plan: RunPlan) -> bool:
    """Ray worker groups train: several devices, a rollout pool of its own, a reward model's or the distillation
    teachers' pool of its own (`reward_model.enable_resource_pool`, `distillation.nnodes`: even beside one trainer
    device), or LATHE_RAY=1 (one device as a Ray worker group of one FSDP2 rank, to check that path on one GPU)."""
    return (plan.is_async or plan.world > 1 or plan.reward_devices > 0 or plan.teacher_devices > 0
            or os.environ.get("LATHE_RAY") == "1")


def _async_steps(cfg, loader_batches: int, total_steps: int) -> int:
    """Fully-async steps: `trainer.total_training_steps`, at most the steps `rollout.total_rollout_steps` prompts
    make (the Rollouter issues no more: more steps would wait forever); without either, the epochs' prompts."""
    t, step = cfg.trainer, cfg.data.train_batch_size
    if cfg.rollout.total_rollout_steps:
        can = max(1, cfg.rollout.total_rollout_steps // step)
        if t.total_training_steps and can < t.total_training_steps:
            log.warning("fully async: rollout.total_rollout_steps=%d prompts make %d steps of %d prompts, fewer than "
                        "trainer.total_training_steps=%d: training stops after %d", cfg.rollout.total_rollout_steps,
                        can, step, t.total_training_steps, can)
        return min(t.total_training_steps or can, can)
    if t.total_training_steps:
        return total_steps
    prompts = loader_batches * cfg.data.gen_batch_size * (cfg.rollout.total_epochs or t.total_epochs)
    return max(1, prompts // step)


def _lora_sizes(model, group, key: str) -> tuple[int, int]:
    """(adapter parameters, parameters of the layers they adapt) of LoRA from `group`'s keys (`key`) on `model`."""
    from lathe.models.lora import target_names
    layers = [model.get_submodule(p) for p in target_names(model, group.target_modules,
                                                             getattr(group, "exclude_modules", None), key=key)]
    return (sum(group.lora_rank * (m.in_features + m.out_features) for m in layers),
            sum(m.weight.numel() for m in layers))


def _inputs_width(model) -> int:
    """The hidden size: the width of `model`'s input embeddings."""
    return model.get_input_embeddings().weight.shape[1]


def log_memory_plan(cfg: LatheConfig, run: RunPlan, model, device: torch.device) -> None:
    """Print what will live where (GiB); refuse a run whose update cannot fit even before activations."""
    from lathe.models.config import SUPPORTED_ARCHITECTURES
    from lathe.train.memory import Part, count_params, format_plan, host_memory, mesh_fixes, pinned_rounding, plan
    from lathe.train.memory_models import other_model_parts
    arr = cfg.actor_rollout_ref
    n = count_params(model)
    head = getattr(model, "lm_head", None)
    critic = (n - (0 if head is None or getattr(model.config, "tie_word_embeddings", False) else head.weight.numel())
              if run.critic is not None else None)
    runs_lathe = type(model).__name__ in SUPPORTED_ARCHITECTURES or getattr(model.config, "architecture", None)
    lathe_engine = arr.rollout.name != "hf" and bool(runs_lathe) and arr.model.impl != "hf"
    replica = arr.rollout.tensor_model_parallel_size
    replicable = type(model).__name__ in ("LatheCausalLM", "LatheVLForConditionalGeneration")
    if replica > 1 and not (lathe_engine and replicable):
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={replica}: tensor-parallel engine replicas run "
            f"lathe's text decoder ({', '.join(sorted(SUPPORTED_ARCHITECTURES))}) and its VL models; this run's "
            f"policy is "
            f"{type(model).__name__}{' (model.impl=hf)' if arr.model.impl == 'hf' else ''}. Fix: set it to 1 (one "
            "engine per device), for as long as the model fits one device")
    from lathe.engine.data_parallel import engine_layout
    dp_size, ep_size = (engine_layout(model, arr.rollout) if lathe_engine
                        else (1, arr.rollout.expert_parallel_size))
    check_always_data_parallel(arr, model, lathe_engine, dp_size)
    tp = replica if not run.is_async else 1         # (the async pool's replicas hold no trainer state)
    kv_seq = 0
    if lathe_engine and not run.is_async:       # lathe's engine: its KV cache, in the rollout dtype, for one sequence of the longest length
        from lathe.engine.kv_cache import KVCache, kv_storage_dtype     # (FP8 with its scales: rollout.kv_cache_dtype)
        from lathe.dtypes import rollout_dtype
        c = getattr(model.config, "text", model.config)          # a VL model: its language model's config
        length = cfg.data.max_prompt_length + cfg.data.max_response_length
        from lathe.engine.linear_state import kv_layers            # (a hybrid model: its full-attention layers)
        from lathe.engine.mla import cache_layout                  # (a DeepSeek-V3 model: its latent, whole per rank)
        heads, head_dim = cache_layout(c)
        head_dim = head_dim or c.hidden_size // c.num_attention_heads
        kv_seq = KVCache.bytes_per_block(kv_layers(c), length, max(1, heads // tp), head_dim,
                                         kv_storage_dtype(arr.rollout.kv_cache_dtype,
                                                          rollout_dtype(arr.rollout.dtype, torch.device(device))),
                                         latent=getattr(c, "mla", None) is not None)
    seqs = math.ceil(run.actor.sequences_per_step / (run.world // tp))     # what one engine replica generates
    lora = _lora_sizes(model, arr.model, "actor_rollout_ref.model") if arr.model.lora_rank > 0 else None
    critic_lora = None                           # a LoRA critic trains its adapters and its value head (hidden + 1)
    if critic is not None and cfg.critic.model.lora_rank > 0:
        critic_lora = _lora_sizes(model, cfg.critic.model, "critic.model")[0] + _inputs_width(model) + 1
    # each model's state per device: 1/(dp_shard x tp) (tensor parallelism cuts it before FSDP2 shards the slices)
    shards = {role: run.mesh(role).dp_shard * run.mesh(role).tp for role in ("actor", "ref", "critic")}
    keys = {"actor": "actor_rollout_ref.actor.fsdp_config.fsdp_size", "critic": "critic.model.fsdp_config.fsdp_size",
            "ref": "actor_rollout_ref.ref.fsdp_config.fsdp_size"}
    used = {"actor": True, "ref": run.needs_ref, "critic": run.critic is not None}
    # the host's memory is checked where this process's node is the ranks' (one node; a Ray cluster's other nodes
    # are not seen from here)
    one_node = cfg.trainer.nnodes == 1 and (not run.is_async or cfg.rollout.nnodes <= 1)
    inputs = model.get_input_embeddings()           # (whole on every rank of an engine replica)
    embeddings = (inputs.weight.numel(), head is not None and head.weight is inputs.weight)

    def planned(engine_experts: tuple[int, int] | None) -> tuple[list[Part], str, bool]:
        """(parts, the plan's text, whether it fits) with the engine's routed experts over `engine_experts`' (expert
        parameters, D) replicas' ranks (data-parallel attention), or None: each replica's whole."""
        parts = plan(cfg, n, device, need_ref=run.needs_ref, critic_params=critic, lathe_engine=lathe_engine,
                     world=run.world, colocated=not run.is_async, lora=lora, critic_lora=critic_lora, shards=shards,
                     engine_experts=engine_experts, embeddings=embeddings)
        parts += other_model_parts(cfg, device, world=run.world, shards=shards)    # reward model/judge, teachers
        masters = next((p for p in parts if p.what.startswith("actor master weights") and not p.on_gpu), None)
        if masters is not None and run.world == 1 and lora is None:   # MasterAdamW's host masters: a pinned block each
            size = masters.nbytes // max(1, n)
            parts.append(Part("actor master weights: pinned rounding (each tensor's block a power of two)",
                              pinned_rounding([p.numel() for p in model.parameters() if p.requires_grad], size), False,
                              why=masters.why))
        fixes = mesh_fixes(parts, rollout_tp=tp, world=run.world, per_node=cfg.trainer.n_gpus_per_node,
                           fsdp_sizes={keys[r]: shards[r] for r in shards if used[r]})
        text, fits = format_plan(parts, device, arr.rollout.gpu_memory_utilization, kv_seq_bytes=kv_seq, seqs=seqs,
                                 mesh_fixes=fixes, host_ranks=run.world if one_node else cfg.trainer.n_gpus_per_node,
                                 host_memory=host_memory() if one_node else None)
        return parts, text, fits

    parts, text, fits = planned(None)
    if dp_size > 1 and not run.is_async:    # data-parallel attention: the routed experts over D x TP ranks (a
        # rollout pool of its own holds no trainer state beside them: it keeps data-parallel attention)
        from lathe.models.moe import sparse_blocks
        experts = sum(p.numel() for b in sparse_blocks(model) for p in b.experts.parameters())
        spread = planned((experts, dp_size))
        if auto_replicas(cfg, (parts, fits), spread[0], device, kv_seq, seqs):
            dp_size, ep_size = 1, replica
        else:
            parts, text, fits = spread
    if replica > 1 or dp_size > 1:  # refused here, before any worker starts, rather than when a replica is cut
        from lathe.engine.tensor_parallel import check_replica
        check_replica(model, replica, ep_size, dp_size)
    log.info("%s", text)
    if not fits:
        raise ValueError(text)


def check_always_data_parallel(arr, model, lathe_engine: bool, dp_size: int) -> None:
    """`rollout.data_parallel_attention=always` where the model known now runs verl's layout as replicas of whole
    experts anyway (`lathe.engine.data_parallel.engine_layout`): refused, not ignored."""
    ro = arr.rollout
    if ro.data_parallel_attention != "always" or ro.data_parallel_size <= 1 or dp_size > 1:
        return
    why = ("this run generates with transformers' generate (rollout.name=hf or model.impl=hf)" if not lathe_engine
           else f"{getattr(model.config, 'architecture', type(model).__name__)} has no mixture-of-experts layers"
           if getattr(model.config, "moe", None) is None
           else f"data-parallel attention runs lathe's text decoder, and this run's policy is {type(model).__name__}")
    raise ValueError(f"actor_rollout_ref.rollout.data_parallel_attention=always with data_parallel_size="
                     f"{ro.data_parallel_size}: {why}, so its engine runs as replicas. Fix: set it to auto or never "
                     "(the same samples)")


# Replicas of whole experts generated 1.23x faster than data-parallel attention under CUDA graphs at
# Qwen3-30B-A3B-12l on 2 H200s (2.89 s against 3.55 a step, gpu_memory_utilization 0.6, two calls:
# docs/distributed.md). A decode step costs about the same at any batch (the weights are read each step), so a KV
# cache that holds only part of a step's sequences runs a second wave of steps, about twice the time: they pay only
# where they hold all that data-parallel attention would run at once.


def auto_replicas(cfg: LatheConfig, replicas: tuple[list, bool], spread: list, device: torch.device, kv_seq: int,
                  seqs: int) -> bool:
    """Whether an engine of data-parallel attention (`lathe.engine.data_parallel`) runs instead as replicas of whole
    experts (`rollout.data_parallel_attention=auto`), on a GPU: where the replicas' plan (`replicas`: parts, whether
    they fit) fits and its KV cache holds all the sequences (of `kv_seq` bytes at their longest) that
    data-parallel attention (`spread`'s parts) would run at once: the replica's `seqs`, or as many as its KV cache
    holds. Then the rollout's expert_parallel_size becomes its tensor-parallel size (what the engine and the driver
    read), with a notice; else a notice says what would let them."""
    from lathe.train.memory import generation_room, resident_bytes, total_memory
    ro = cfg.actor_rollout_ref.rollout
    parts, fits = replicas
    if ro.data_parallel_attention != "auto" or device.type != "cuda" or not kv_seq:
        return False
    gmu = ro.gpu_memory_utilization
    room, spread_room = generation_room(parts, device, gmu), generation_room(spread, device, gmu)
    if room is None or spread_room is None:
        return False
    held, spread_held = int(room // kv_seq), int(spread_room // kv_seq)
    if not fits or held < max(1, min(seqs, spread_held)):
        need = math.ceil(100 * (resident_bytes(parts) + kv_seq * seqs) / total_memory(device)) / 100
        log.info("engine: rollout.data_parallel_size=%d runs as data-parallel attention: replicas of whole "
                 "experts, a little faster where they fit, would hold %d of a replica's %d sequences at their longest "
                 "(data-parallel attention %d)%s", ro.data_parallel_size, held, seqs, spread_held,
                 f"; rollout.gpu_memory_utilization={need} would let them hold all" if need < 0.95 else "")
        return False
    log.info("engine: rollout.data_parallel_size=%d with expert_parallel_size=%d runs as %d replicas of whole experts "
             "(expert_parallel_size %d): they hold %d of a replica's %d sequences at their longest and generate a "
             "little faster than data-parallel attention, with no collective a layer "
             "(rollout.data_parallel_attention=always keeps it)", ro.data_parallel_size, ro.expert_parallel_size,
             ro.data_parallel_size, ro.tensor_model_parallel_size, min(held, seqs), seqs)
    ro.expert_parallel_size = ro.tensor_model_parallel_size
    return True


def resume(trainer: Trainer, path: Path) -> None:
    state = load_trainer_state(path)
    trainer.worker.load_checkpoint(path / "actor")
    if trainer.critic is not None:
        trainer.critic.load_checkpoint(path / "critic")
    trainer.loader.load_state_dict(state["dataloader"])
    trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    restore_rng(state["rng"])
    trainer.global_step = state["global_step"]
    trainer.resumed_from, trainer.resume_state = path, state
    log.info("resumed from %s (step %d)", path, trainer.global_step)


def prompt_batch(rows: list[dict], step: int, round_: int = 0) -> Batch:
    """A dataloader batch as a `Batch`; `uid` groups the samples of one prompt (GRPO's index).

    When any row has images: `multi_modal_inputs` ({pixel_values (patches, D), image_grid_thw (images, 3)}) and
    `multi_modal_data` ({"image": [PIL]}) per row, None for text rows; as non-tensors they follow their rows
    through `repeat`/`select`/`concat`, and the trainer's log-prob micro-batches take their images from them."""
    keys = ("prompt_ids", "raw_prompt", "data_source", "ground_truth", "extra_info", "index")
    keys += (REWARD_SOURCE,) if rows and REWARD_SOURCE in rows[0] else ()      # data.reward_fn_key's column
    nt = {k: [r[k] for r in rows] for k in keys}
    nt["uid"] = [f"{step}:{round_}:{i}" for i in range(len(rows))]
    if any("agent_name" in r for r in rows):                                   # a row's custom agent loop
        nt["agent_name"] = [r.get("agent_name") for r in rows]
    nt.update(multimodal_non_tensors(rows))
    return Batch(non_tensors=nt)

