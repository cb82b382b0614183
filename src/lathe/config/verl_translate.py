"""verl's training-backend keys that lathe has an equivalent for, turned into lathe's keys as they are set.

verl trains with FSDP, Megatron, VeOmni or torchtitan (``actor.strategy``, ``model_engine``); lathe trains
every model with its FSDP2 trainer. A backend key whose meaning lathe has is set on lathe's key, in the same
layer and in order, so a later ``fsdp_config`` override still wins:

* ``{megatron,veomni,torchtitan}.param_offload`` / ``optimizer_offload`` -> ``fsdp_config.*`` (the role's);
* ``veomni.enable_fsdp_offload`` -> ``fsdp_config.offload_policy``;
* ``veomni.fsdp_size``, ``torchtitan.data_parallel_shard_size`` -> ``fsdp_config.fsdp_size`` (the shard group's
  devices: hybrid sharding when fewer than all);
* ``megatron.override_transformer_config.recompute_granularity`` full/selective, ``torchtitan.
  activation_checkpoint`` full/none -> the model's ``enable_gradient_checkpointing`` (lathe recomputes whole
  decoder layers); beside ``recompute_granularity=full``, ``recompute_method=block`` with ``recompute_num_layers=N``
  (the first N layers of each pipeline stage recompute, the rest keep their activations) -> the model's
  ``gradient_checkpointing_layers`` = N x the pipeline stages (x the virtual stages): the same share of the layers,
  counted over lathe's one stack (`block_recompute`, once every key is set; a count set on lathe's key wins), while
  ``recompute_method=uniform`` (chunks of N layers, each chunk recomputed) recomputes every layer, as
  ``enable_gradient_checkpointing`` alone does. torchtitan's layer choice (``selective_ac_option``) is not a verl
  key: verl's ``torchtitan.activation_checkpoint`` names the mode only;
* ``megatron.dtype``, ``torchtitan.dtype``, ``fsdp_config.dtype`` / ``critic.fsdp.dtype`` -> ``fsdp_config.
  mixed_precision.param_dtype``; ``veomni.mixed_precision=false`` -> param_dtype fp32;
* ``veomni.ulysses_parallel_size``, and Megatron's and torchtitan's ``context_parallel_size`` -> the role's
  ``ulysses_sequence_parallel_size`` (context parallelism splits each sequence over the group as Ulysses does; the
  attention's all-to-all differs from Megatron's ring, the math does not);
* ``megatron.tensor_model_parallel_size`` (also under ``megatron.override_transformer_config``),
  ``torchtitan.tensor_parallel_size`` -> ``fsdp_config.tensor_parallel_size`` (lathe's tensor parallelism); set
  beside a context-parallel size (verl's Megatron scripts for large models and long responses), the two run as
  tensor parallelism x Ulysses in one model (`lathe.train.ulysses`: the all-to-all splits each tensor-parallel rank's
  heads again), a mini-batch split over world / (TP x CP) data-parallel groups as verl splits it;
* ``megatron.expert_model_parallel_size``, ``torchtitan.expert_parallel_size``, ``veomni.expert_parallel_size`` ->
  ``fsdp_config.expert_parallel_size`` (lathe's expert parallelism). Beside an expert-parallel size above 1, a role's
  Megatron or torchtitan tensor-parallel size translates to nothing once every key is set (`drop_tp_beside_ep`):
  Megatron cuts the dense layers over its TP ranks and the experts over the data- x tensor-parallel ranks; lathe
  FSDP-shards the dense layers over those devices instead (the same computation, another memory layout; a mini-batch
  is then split over every device), which runs for every MoE family lathe has (its TP x EP cuts Qwen3-MoE's,
  Qwen3.5-MoE's and Qwen3-Next's layers only, and is not yet measured against FSDP x EP on GPUs); one notice says so
  (`tp_beside_ep_notice`). lathe's own ``fsdp_config.tensor_parallel_size`` beside EP keeps tensor parallelism
  where EP is a multiple or a divisor of it (`lathe.train.expert_parallel`), and is refused otherwise;
* Megatron's ``pipeline_model_parallel_size`` / ``virtual_pipeline_model_parallel_size`` and torchtitan's
  ``pipeline_parallel_size`` set no lathe key: pipeline stages compute the same loss and gradients as the whole
  model (a layout, not another computation), so lathe FSDP-shards each layer over those devices instead of cutting
  the model into stages; those devices then hold data of their own (a mini-batch is split over world / (TP x
  Ulysses) data-parallel groups, verl's over world / (TP x PP x CP)); one notice says so (`pipeline_notice`);
* a role whose Ulysses size is the one its Megatron / torchtitan context-parallel size gave runs packed: where
  ``use_remove_padding`` is false there, it becomes true once every key is set (`pack_for_context_parallel`; padding
  or packing changes the layout, not what is computed; Megatron's CP splits padded micro-batches itself, lathe's
  Ulysses splits the packed stream); one notice says so (`context_parallel_notice`);
* ``rollout.data_parallel_size`` D with expert-parallel size D x TP is data-parallel attention in one engine of
  D x TP ranks (`lathe.engine.data_parallel`: D replicas of TP ranks in lockstep, a MoE model's experts over all
  D x TP ranks; replicas of whole experts where it does not run: a dense model, streamed requests, speculative
  decoding; `data_parallel_attention.py` says which, `engine_data_parallel` warns); ``rollout.moe_tensor_parallel_size`` M with M x EP = TP runs as whole
  experts over the TP ranks instead of each cut over M (`engine_data_parallel` sets EP = TP);
* Megatron Lite's ``engine`` group (verl's ``megatron_lite`` backend; `verl_keys.MLITE_ENGINE`) as Megatron's:
  ``engine.tp`` / ``ep`` / ``cp`` as the tensor-, expert- and context-parallel sizes above, ``engine.pp`` / ``vpp`` as
  pipeline stages, ``engine.{param,optimizer}_offload`` as offload, ``engine.impl_cfg.recompute`` ([full] or
  [selective]) -> ``enable_gradient_checkpointing``;
* the actor's ``{megatron,veomni}.router_replay.mode`` -> ``actor.router_replay.mode`` (routing replay, R2/R3);
* the actor's ``megatron.override_transformer_config.fp8=hybrid`` (Transformer Engine's FP8 linear layers, e4m3
  forward and e5m2 gradients) -> ``actor.fsdp_config.fp8_training=tensorwise`` (torchao's float8 with one dynamic
  scale per tensor, `lathe.train.fp8`); ``fp8_recipe`` tensorwise and delayed (an amax history instead of the
  current amax: the same per-tensor scales, estimated) both run so, the other recipes are refused (support_verl);
* Megatron's ``optim.eps`` -> ``optim.override_optimizer_config.eps`` (an argument of the role's optimizer class,
  `lathe.config.rules_optim`) (Megatron's schedule keys, ``optim.lr_decay_style`` and the rest, are lathe's own);
* the actor's ``megatron.override_transformer_config.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` ->
  ``actor.moe_aux_loss_coeff`` / ``actor.moe_z_loss_coeff`` (Megatron's router losses, `lathe.models.moe`);
* verl's newer megatron-style LoRA group ``model.lora.{rank,alpha,dropout,adapter_path}`` -> ``model.lora_*``;
  beside expert parallelism one notice says that verl's Megatron LoRA adapts the routed experts too and lathe's
  leaves them frozen (`lora_experts_notice`).

A value equal to verl's default translates to nothing: a full verl config file lists every backend key at its
default, and those must not undo the lathe keys set beside them. ``support_verl.py`` marks these keys as
translated; the rest of the backend keys are judged there.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

from .verl_keys import verl_default

# role -> (its fsdp group, its model group, its optim group); the reference never trains
ROLE = {"actor_rollout_ref.actor": ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.model",
                                    "actor_rollout_ref.actor.optim"),
        "actor_rollout_ref.ref": ("actor_rollout_ref.ref.fsdp_config", None, None),
        "critic": ("critic.model.fsdp_config", "critic.model", "critic.optim")}
DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}

# value -> lathe value (None: nothing to set)
Map = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


def _checkpointing(on: set, off: set) -> Map:
    return lambda v: True if v in on else False if v in off else None


def _recompute(value: Any) -> Any:
    """Megatron Lite's `impl_cfg.recompute`, a list of what it recomputes ([full], [selective], ...): any -> on."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return True if any(v in ("full", "selective") for v in items) else None


CP_DOC = "ulysses_sequence_parallel_size (split as Ulysses splits it: the same math)"
FP8_DOC = ("hybrid (the actor's): fsdp_config.fp8_training=tensorwise (torchao's per-tensor dynamic scaling, e4m3 "
           "forward and e5m2 gradients; Megatron's fp8_recipe tensorwise or delayed)")


def _fp8(value: Any) -> Any:
    """Megatron's `fp8` format: hybrid (e4m3 forward, e5m2 gradients) is torchao's tensorwise recipe; e4m3 gradients
    are not a lathe recipe (support_verl refuses them)."""
    return "tensorwise" if value == "hybrid" else None

# (pattern below a role, lathe key: 'fsdp.<k>' / 'model.<k>' / 'optim.<k>' in the role's group or 'role.<k>' in the
# role itself, value map, doc)
TP_DOC = "fsdp_config.tensor_parallel_size (beside expert parallelism: nothing, FSDP over those devices)"
RULES: tuple[tuple[str, str, Map, str], ...] = (
    ("megatron.tensor_model_parallel_size", "fsdp.tensor_parallel_size", _same, TP_DOC),
    ("engine.tp", "fsdp.tensor_parallel_size", _same, TP_DOC),
    ("engine.ep", "fsdp.expert_parallel_size", _same, "fsdp_config.expert_parallel_size"),
    ("engine.cp", "role.ulysses_sequence_parallel_size", _same, CP_DOC),
    ("engine.impl_cfg.recompute", "model.enable_gradient_checkpointing", _recompute,
     "full/selective among them: model.enable_gradient_checkpointing=true"),
    ("megatron.override_transformer_config.tensor_model_parallel_size", "fsdp.tensor_parallel_size", _same, TP_DOC),
    ("torchtitan.tensor_parallel_size", "fsdp.tensor_parallel_size", _same, TP_DOC),
    ("megatron.expert_model_parallel_size", "fsdp.expert_parallel_size", _same, "fsdp_config.expert_parallel_size"),
    ("torchtitan.expert_parallel_size", "fsdp.expert_parallel_size", _same, "fsdp_config.expert_parallel_size"),
    ("veomni.expert_parallel_size", "fsdp.expert_parallel_size", _same, "fsdp_config.expert_parallel_size"),
    ("veomni.ulysses_parallel_size", "role.ulysses_sequence_parallel_size", _same, "ulysses_sequence_parallel_size"),
    ("megatron.context_parallel_size", "role.ulysses_sequence_parallel_size", _same,
     CP_DOC),
    ("megatron.override_transformer_config.context_parallel_size", "role.ulysses_sequence_parallel_size", _same,
     CP_DOC),
    ("torchtitan.context_parallel_size", "role.ulysses_sequence_parallel_size", _same,
     CP_DOC),
    ("*.param_offload", "fsdp.param_offload", _same, "fsdp_config.param_offload"),
    ("*.optimizer_offload", "fsdp.optimizer_offload", _same, "fsdp_config.optimizer_offload"),
    ("veomni.enable_fsdp_offload", "fsdp.offload_policy", _same, "fsdp_config.offload_policy"),
    ("veomni.fsdp_size", "fsdp.fsdp_size", _same, "fsdp_config.fsdp_size"),
    ("torchtitan.data_parallel_shard_size", "fsdp.fsdp_size", _same, "fsdp_config.fsdp_size"),
    ("megatron.override_transformer_config.recompute_granularity", "model.enable_gradient_checkpointing",
     _checkpointing({"full", "selective"}, set()), "full/selective: model.enable_gradient_checkpointing=true"),
    ("torchtitan.activation_checkpoint", "model.enable_gradient_checkpointing",
     _checkpointing({"full", "selective"}, {"none"}), "full: gradient checkpointing on; none: off"),
    # set once every key is (`block_recompute`: it reads granularity, method and count together)
    ("megatron.override_transformer_config.recompute_method", "model.gradient_checkpointing_layers", lambda v: None,
     "block beside recompute_granularity=full: model.gradient_checkpointing_layers = recompute_num_layers x the "
     "pipeline stages (the first layers recompute, the rest keep their activations); uniform: every layer recomputed "
     "(enable_gradient_checkpointing)"),
    ("megatron.override_transformer_config.recompute_num_layers", "model.gradient_checkpointing_layers",
     lambda v: None, "with recompute_method=block (see recompute_method)"),
    ("megatron.override_transformer_config.fp8", "actor.fsdp_config.fp8_training", _fp8, FP8_DOC),
    ("*.dtype", "fsdp.mixed_precision.param_dtype", DTYPES.get, "fsdp_config.mixed_precision.param_dtype"),
    ("veomni.mixed_precision", "fsdp.mixed_precision.param_dtype", lambda v: None if v else "fp32",
     "false: fsdp_config.mixed_precision.param_dtype=fp32"),
    ("megatron.router_replay.mode", "actor.router_replay.mode", _same, "router_replay.mode (the actor's)"),
    ("megatron.override_transformer_config.moe_aux_loss_coeff", "actor.moe_aux_loss_coeff", _same,
     "the actor's moe_aux_loss_coeff (Megatron's switch loss per sparse layer, summed over the layers)"),
    ("megatron.override_transformer_config.moe_z_loss_coeff", "actor.moe_z_loss_coeff", _same,
     "the actor's moe_z_loss_coeff (Megatron's router z-loss)"),
    ("veomni.router_replay.mode", "actor.router_replay.mode", _same, "router_replay.mode (the actor's)"),
    ("optim.eps", "optim.override_optimizer_config.eps", _same,
     "optim.override_optimizer_config.eps (the optimizer's eps argument)"),
)
BACKEND_PREFIXES = ("megatron.", "veomni.", "torchtitan.", "engine.", "fsdp_config.", "fsdp.", "optim.")
LORA = {"rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout", "adapter_path": "lora_adapter_path"}
CRITIC_LORA = ("rank", "alpha")                       # the critic's model group has no lora_dropout/adapter path


def _role(key: str) -> tuple[str, str] | None:
    """(role prefix, the rest) for a key below actor/ref/critic."""
    for role in ROLE:
        if key.startswith(role + "."):
            return role, key[len(role) + 1:]
    return None


def rule_for(key: str) -> tuple[str, str] | None:
    """(lathe key, what it becomes) for a verl key that translates, else None."""
    for model, leaves in (("actor_rollout_ref.model", tuple(LORA)), ("critic.model", CRITIC_LORA)):
        leaf = key[len(model) + len(".lora."):] if key.startswith(model + ".lora.") else ""
        if leaf in leaves:
            return f"{model}.{LORA[leaf]}", f"{model}.{LORA[leaf]}"
    found = _role(key)
    if found is None:
        return None
    role, rest = found
    groups = {**dict(zip(("fsdp", "model", "optim"), ROLE[role])), "role": role,
              "actor": role if role == "actor_rollout_ref.actor" else None}
    if not rest.startswith(BACKEND_PREFIXES):
        return None
    for pattern, target, _, doc in RULES:
        if fnmatchcase(rest, pattern) and not (rest.startswith(("fsdp_config.", "fsdp.")) and "offload" in target):
            group, _, leaf = target.partition(".")
            return (f"{groups[group]}.{leaf}", doc) if groups[group] else None
    return None


def translate(key: str, value: Any) -> list[tuple[str, Any]]:
    """The lathe (key, value) pairs a verl key's value sets; [] when it sets none (or is verl's default)."""
    found = rule_for(key)
    if found is None or value == verl_default(key):
        return []
    target, _ = found
    if ".lora." in key:
        return [(target, value)]
    rest = _role(key)[1]
    mapped = next(m for pattern, _, m, _ in RULES if fnmatchcase(rest, pattern))(value)
    return [] if mapped is None else [(target, mapped)]


# the verl spellings of a role's tensor-parallel size (see RULES)
TP_SPELLINGS = ("megatron.tensor_model_parallel_size",
                "megatron.override_transformer_config.tensor_model_parallel_size", "torchtitan.tensor_parallel_size",
                "engine.tp")


def _fsdp(cfg: Any, role: str) -> Any:
    node = cfg
    for part in ROLE[role][0].split("."):
        node = getattr(node, part)
    return node


def _verl_tp(cfg: Any, role: str) -> set[int]:
    """The tensor-parallel sizes above 1 that `role`'s Megatron / torchtitan keys give."""
    given = (cfg.verl_keys.get(f"{role}.{spelling}") for spelling in TP_SPELLINGS)
    return {v for v in given if isinstance(v, int) and v > 1}


def drop_tp_beside_ep(cfg: Any) -> None:
    """Each role whose tensor-parallel size is the one its Megatron / torchtitan key gave, beside an expert-parallel
    size above 1, runs without tensor parallelism (module doc); called once every layer of keys is set."""
    for role in ROLE:
        fsdp = _fsdp(cfg, role)
        if fsdp.expert_parallel_size > 1 and fsdp.tensor_parallel_size in _verl_tp(cfg, role):
            fsdp.tensor_parallel_size = 1


def tp_beside_ep_notice(cfg: Any) -> str | None:
    """The one notice for the roles whose Megatron / torchtitan tensor-parallel size `drop_tp_beside_ep` dropped."""
    roles = [role for role in ROLE if _fsdp(cfg, role).expert_parallel_size > 1
             and _fsdp(cfg, role).tensor_parallel_size == 1 and _verl_tp(cfg, role)]
    if not roles:
        return None
    sizes = ", ".join(f"{role}: TP {max(_verl_tp(cfg, role))} beside EP {_fsdp(cfg, role).expert_parallel_size}"
                      for role in roles)
    return (f"Megatron's/torchtitan's tensor-parallel size beside expert parallelism ({sizes}) translates to "
            "nothing: Megatron cuts the dense layers over its TP ranks and the experts over the data- x tensor-"
            "parallel ranks; lathe FSDP-shards the dense layers over those devices instead (the same computation, "
            "another memory layout) and splits a mini-batch over every device. To keep tensor parallelism (Qwen3-"
            "MoE, Qwen3.5-MoE and Qwen3-Next; expert_parallel_size a multiple or a divisor of it), set lathe's fsdp_config."
            "tensor_parallel_size.")


RECOMPUTE = "megatron.override_transformer_config.recompute_"
TRAINED_MODEL = {"actor_rollout_ref.actor": "actor_rollout_ref.model", "critic": "critic.model"}


def megatron_recompute(cfg: Any, role: str) -> dict[str, Any]:
    """`role`'s Megatron recompute_{granularity,method,num_layers} as given (None where unset), by leaf."""
    return {leaf: cfg.verl_keys.get(f"{role}.{RECOMPUTE}{leaf}") for leaf in ("granularity", "method", "num_layers")}


def block_recompute_layers(cfg: Any, role: str) -> int | None:
    """The layers `role`'s Megatron keys recompute over lathe's whole stack when they name the block method
    (recompute_granularity=full, recompute_method=block, recompute_num_layers=N >= 0): N per pipeline stage, times
    the stages and virtual stages (module doc); None for any other combination (uniform, selective, unset)."""
    given = megatron_recompute(cfg, role)
    n = given["num_layers"]
    if (given["granularity"], given["method"]) != ("full", "block") or isinstance(n, bool) or not isinstance(n, int) \
            or n < 0:
        return None
    for leaf in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
        stages = cfg.verl_keys.get(f"{role}.megatron.{leaf}")
        n *= stages if isinstance(stages, int) and stages > 1 else 1
    return n


def block_recompute_counts(cfg: Any) -> dict[str, tuple[str, int]]:
    """role -> (its model group, the count `block_recompute` sets there) for each trained role whose Megatron keys
    name the block method, where lathe's key is unset (a count given there wins), gradient checkpointing is on (a
    later enable_gradient_checkpointing=false turns all recomputation off) and the models run lathe's decoder (with
    actor_rollout_ref.model.impl=hf, the critic's too, transformers trains them without recomputation, and a count
    would be refused)."""
    out = {}
    if cfg.actor_rollout_ref.model.impl == "hf":
        return out
    for role, group in TRAINED_MODEL.items():
        n, model = block_recompute_layers(cfg, role), _node(cfg, group)
        if n is not None and model.enable_gradient_checkpointing and model.gradient_checkpointing_layers is None:
            out[role] = group, n
    return out


def block_recompute(cfg: Any) -> None:
    """Set each trained model's `gradient_checkpointing_layers` from its role's Megatron block recompute (module
    doc, `block_recompute_counts`), called once every layer of keys is set."""
    for group, n in block_recompute_counts(cfg).values():
        _node(cfg, group).gradient_checkpointing_layers = n


# the verl spellings of a role's pipeline-parallel sizes (stages; virtual stages per device)
PP_SPELLINGS = ("megatron.pipeline_model_parallel_size", "megatron.virtual_pipeline_model_parallel_size",
                "torchtitan.pipeline_parallel_size", "engine.pp", "engine.vpp")


def _verl_pp(cfg: Any, role: str) -> list[str]:
    """'PP 2', 'virtual PP 2' for the pipeline-parallel sizes above 1 that `role`'s Megatron / torchtitan keys give."""
    out = []
    for spelling in PP_SPELLINGS:
        value = cfg.verl_keys.get(f"{role}.{spelling}")
        if isinstance(value, int) and value > 1:
            out.append(f"{'virtual ' * spelling.endswith(('.virtual_pipeline_model_parallel_size', '.vpp'))}PP "
                       f"{value}")
    return out


def pipeline_notice(cfg: Any) -> str | None:
    """The one notice for the roles whose Megatron / torchtitan pipeline-parallel size runs as FSDP sharding."""
    sizes = ", ".join(f"{role}: {' and '.join(_verl_pp(cfg, role))}" for role in ROLE if _verl_pp(cfg, role))
    if not sizes:
        return None
    return (f"Megatron's/torchtitan's pipeline-parallel size ({sizes}) runs as FSDP sharding over those devices: "
            "pipeline stages compute the same loss and gradients as the whole model (a layout, not another "
            "computation), so lathe shards each layer over the stages' devices instead of cutting the model into "
            "stages; those devices then hold data of their own, and a mini-batch is split over world / (TP x Ulysses)"
            " data-parallel groups where verl splits it over world / (TP x PP x CP).")


# the verl spellings of a role's context-parallel size (see RULES: each sets the role's Ulysses size)
CP_SPELLINGS = ("megatron.context_parallel_size", "megatron.override_transformer_config.context_parallel_size",
                "torchtitan.context_parallel_size", "engine.cp")
PACKED = {"actor_rollout_ref.actor": "actor_rollout_ref.model", "actor_rollout_ref.ref": "actor_rollout_ref.model",
          "critic": "critic.model"}       # the group whose use_remove_padding packs the role's forwards


def _node(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _cp_roles(cfg: Any) -> list[tuple[str, int]]:
    """(role, size) for each role whose Ulysses size above 1 is the one its context-parallel key gave."""
    out = []
    for role in ROLE:
        given = {cfg.verl_keys.get(f"{role}.{spelling}") for spelling in CP_SPELLINGS}
        size = _node(cfg, role).ulysses_sequence_parallel_size
        if isinstance(size, int) and size > 1 and size in given:
            out.append((role, size))
    return out


def _unpacked_cp(cfg: Any) -> list[str]:
    """The packed-forward switches that are off for a role whose Ulysses size came from a context-parallel key."""
    return sorted({f"{PACKED[role]}.use_remove_padding" for role, _ in _cp_roles(cfg)
                   if not _node(cfg, PACKED[role]).use_remove_padding})


def pack_for_context_parallel(cfg: Any) -> None:
    """Turn on the packed forward (use_remove_padding) of each role whose Ulysses size came from a context-parallel
    key (module doc); called after the keys are judged (`context_parallel_notice` names what it turns on)."""
    for switch in _unpacked_cp(cfg):
        _node(cfg, switch.rpartition(".")[0]).use_remove_padding = True


def context_parallel_notice(cfg: Any) -> str | None:
    """The one notice for the packed-forward switches `pack_for_context_parallel` is about to turn on."""
    switches = _unpacked_cp(cfg)
    if not switches:
        return None
    sizes = ", ".join(f"{role}: CP {size}" for role, size in _cp_roles(cfg))
    return (f"Megatron's/torchtitan's context-parallel size ({sizes}) runs as Ulysses sequence parallelism over each "
            f"micro-batch's packed stream, so {' and '.join(switches)}=false becomes true (padding or packing changes "
            "the layout, not what is computed).")


def lora_experts_notice(cfg: Any) -> str | None:
    """The one notice for verl's Megatron-style LoRA group beside expert parallelism: Megatron-Bridge's LoRA (verl's
    default `model.lora.target_modules`: linear_qkv, linear_proj, linear_fc1, linear_fc2) adapts each routed
    expert's linear_fc1/linear_fc2 too; lathe's leaves the routed experts frozen (`lathe.models.lora`)."""
    rank = cfg.verl_keys.get("actor_rollout_ref.model.lora.rank")
    eps = {_fsdp(cfg, role).expert_parallel_size for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")}
    if not isinstance(rank, int) or rank <= 0 or max(eps) <= 1:
        return None
    return (f"actor_rollout_ref.model.lora.rank={rank} beside expert parallelism: verl's Megatron LoRA (its "
            "model.lora.target_modules, by default linear_qkv, linear_proj, linear_fc1, linear_fc2) also adapts each "
            "routed expert's linear_fc1/linear_fc2; lathe's LoRA adapts the linear layers actor_rollout_ref.model."
            f"target_modules={cfg.actor_rollout_ref.model.target_modules!r} names (attention, dense MLPs, shared "
            "experts) and leaves the routed experts frozen, cut over the expert-parallel ranks (fewer trainable "
            "parameters than verl's run).")


def wide_expert_parallel(cfg: Any) -> None:
    """An expert-parallel size E wider than the tensor-parallel size T with no data-parallel size beside it (verl's
    Qwen3-235B script: EP 64 over TP 8): verl asserts EP = TP x data_parallel_size and stops there, but the intent is
    plain, the experts spread over E / T engines' ranks (data-parallel attention); lathe reads it as
    data_parallel_size = E / T, with a notice, when E / T x T ranks divide the rollout devices (else the rules refuse
    it, naming the sizes)."""
    import warnings
    from .plan import rollout_devices, trainer_devices
    from .errors import IgnoredKeysWarning
    from .data_parallel_attention import data_parallel_attention_lacks
    ro = cfg.actor_rollout_ref.rollout
    tp, ep = ro.tensor_model_parallel_size, ro.expert_parallel_size
    devices = rollout_devices(cfg) or trainer_devices(cfg)
    if (ro.data_parallel_size > 1 or tp < 1 or not ep or ep <= tp or ep % tp or devices % ep
            or ro.moe_tensor_parallel_size > 1):
        return
    ro.data_parallel_size = ep // tp
    lacks = data_parallel_attention_lacks(cfg)
    lacks = f"; with {lacks}, whole over each replica's ranks instead" if lacks else ""
    warnings.warn(f"actor_rollout_ref.rollout.expert_parallel_size={ep} with tensor_model_parallel_size={tp} and no "
                  f"data_parallel_size: verl requires EP = TP x data_parallel_size and stops here; lathe reads it as "
                  f"data_parallel_size={ep // tp} (data-parallel attention: {ep // tp} engine replicas of {tp} "
                  f"rank(s) each, a mixture-of-experts model's experts over all {ep} ranks{lacks}). Set "
                  "rollout.data_parallel_size to say so yourself.",
                  IgnoredKeysWarning, stacklevel=2)


def engine_data_parallel(cfg: Any) -> None:
    """verl's expert-parallel size wider than TP with no data-parallel size reads as data-parallel attention
    (`wide_expert_parallel`), and its moe_tensor_parallel_size M x expert_parallel_size = TP as whole experts over a
    replica (support_rollout judges both and gives the notices): the expert-parallel size TP / M becomes the
    replica's TP; so does verl's EP = D x TP where data-parallel attention does not run (`data_parallel_attention.
    data_parallel_attention_lacks`: replicas of whole experts). Called after the keys are judged. (Elsewhere
    data-parallel attention stays as verl writes it: `lathe.engine.data_parallel.engine_layout` runs it.)"""
    import warnings
    from .errors import IgnoredKeysWarning
    from .data_parallel_attention import data_parallel_attention_lacks, data_parallel_verdict
    verdict = data_parallel_verdict(cfg)
    if verdict is not None and verdict[0] == "warn":        # (a refusal is the rules': `check_rollout_tp`)
        warnings.warn(f"1 config key set here runs otherwise in lathe:\n  - {verdict[1]}", IgnoredKeysWarning,
                      stacklevel=2)
    ro = cfg.actor_rollout_ref.rollout
    wide_expert_parallel(cfg)
    tp, ep, moe_tp = ro.tensor_model_parallel_size, ro.expert_parallel_size, ro.moe_tensor_parallel_size
    if (moe_tp > 1 and ep * moe_tp == tp) or (ro.data_parallel_size > 1 and ep == ro.data_parallel_size * tp
                                              and data_parallel_attention_lacks(cfg) is not None
                                              and ro.data_parallel_attention != "always"):   # (the rules refuse)
        ro.expert_parallel_size = tp


# verl's Megatron distributed-checkpoint keys (engine/megatron.yaml); the path is read only with the switch on, as
# verl's `transformer_impl.py` reads it (`load_mcore_dist_weights(module, engine_config.dist_checkpointing_path)`)
DIST_USE, DIST_PATH = "megatron.use_dist_checkpointing", "megatron.dist_checkpointing_path"
DIST_KEY = f"actor_rollout_ref.actor.{DIST_PATH}"


def dist_checkpoint(cfg: Any, role: str = "actor_rollout_ref.actor") -> str | None:
    """The Megatron distributed checkpoint `role` starts from: its `dist_checkpointing_path` ('' when unset, which the
    start-up checks refuse) when its `use_dist_checkpointing` is true, else None (the Hugging Face weights of
    model.path). The actor's is the policy's (`lathe.models.megatron_ckpt` reads it); the reference copies the actor's
    weights as loaded, so support_verl requires the reference's to be the same."""
    if cfg.verl_keys.get(f"{role}.{DIST_USE}") is not True:
        return None
    path = cfg.verl_keys.get(f"{role}.{DIST_PATH}")
    return "" if path is None else str(path)


def dist_checkpoint_prefix(cfg: Any, role: str = "actor_rollout_ref.actor") -> str:
    """What the checkpoint's saver put before every model key (verl's `megatron.dist_checkpointing_prefix`, e.g. NeMo
    2's 'module.'; verl passes it to `sharded_state_dict(prefix=...)`)."""
    return str(cfg.verl_keys.get(f"{role}.megatron.dist_checkpointing_prefix") or "")
