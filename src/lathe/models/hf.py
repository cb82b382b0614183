"""Loading causal LMs and tokenizers: a local Hugging Face directory, a hub id, or the built-in tiny model.

A local directory never touches the network. A hub id is fetched only when the user names one, and an
offline failure says so plainly. `trust_remote_code` stays off unless the user sets it.

Models load through transformers (the config and checkpoint reader of record); `select_impl` then moves
the weights of a supported architecture into lathe's own decoder (`lathe_from_transformers`), which is
what the trainer runs (`actor_rollout_ref.model.impl`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path

import torch

from lathe.models.paths import (
    BUILTIN_PREFIX,
    BUILTIN_SHAPES,
    HUB_ID,
    ModelLoadError,
    is_builtin,
    resolve,
    unknown_builtin,
)
from lathe.models.rope import cast_keeping_rope
from lathe.track.progress import phase

log = logging.getLogger("lathe")

IMPLS = ("auto", "lathe", "hf")


def load_tokenizer(path: str, *, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer of `path` (a local directory, a hub id, or `builtin:<name>`).

    `chat_template` (verl's `actor_rollout_ref.model.custom_chat_template`, a Jinja template) replaces the
    tokenizer's own, so everything that renders prompts or saves the tokenizer uses it.
    """
    tok = _tokenizer(path, trust_remote_code)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def import_external_libs(libs: dict[str, str | None]) -> None:
    """Import each module named by a config key (verl's `external_lib`: code that registers custom
    architectures with transformers), before any model loads. A failing import names the key."""
    for key, module in libs.items():
        if not module:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # an import can fail in any way; the user needs the key and the module
            raise ModelLoadError(f"{key}={module!r}: importing module {module!r} failed ({type(e).__name__}: {e}). "
                                 f"Fix: install it or add its directory to PYTHONPATH, or remove {key}.") from e
        log.info("imported %s (%s)", module, key)


def _tokenizer(path: str, trust_remote_code: bool):
    if is_builtin(path):
        from lathe.data.builtin import builtin_tokenizer
        return builtin_tokenizer()
    from transformers import AutoTokenizer
    local = resolve(path)
    try:
        tok = AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code,
                                            local_files_only=Path(local).is_dir())
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(path, "tokenizer", e)) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                   vocab_size: int | None = None, seed: int = 0, override_config: dict | None = None):
    """A causal LM from `path`. `builtin:<shape>` builds a random model (seeded) of a named shape."""
    if is_builtin(path):
        return build_builtin_model(path[len(BUILTIN_PREFIX):], vocab_size=vocab_size, seed=seed, dtype=dtype)
    from transformers import AutoModelForCausalLM
    local = resolve(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            local, trust_remote_code=trust_remote_code, dtype=dtype, local_files_only=Path(local).is_dir(),
            output_loading_info=True, **(override_config or {}))
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(path, "model", e)) from e
    problem = loading_problem(info, type(model).__name__)
    if problem:
        raise ModelLoadError(f"{path}: {problem}")
    return model


def loading_problem(info: dict, architecture: str) -> str | None:
    """What is wrong with a checkpoint, from transformers' `output_loading_info`: tensors the model needs that the
    checkpoint lacks (transformers would initialise them at random), tensors it does not know, shape mismatches.
    None when the checkpoint holds exactly the model's weights."""
    parts = []
    for key, what in (("missing_keys", "missing (they would be initialised at random)"),
                      ("unexpected_keys", "not part of the model"), ("mismatched_keys", "of the wrong shape")):
        names = sorted(str(k) for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            parts.append(f"{len(names)} tensor(s) {what}: {shown}")
    if not parts:
        return None
    return (f"the checkpoint does not hold the weights of {architecture}: " + "; ".join(parts) + ". It is "
            "incomplete, renamed or saved from another architecture; lathe does not train a model with weights "
            "it did not load. Fix: re-export or re-download the checkpoint (or point model.path at the right one).")


def load_policy(path: str, *, impl: str = "auto", needs_transformers: bool = False, trust_remote_code: bool = False,
                vocab_size: int | None = None, seed: int = 0, override_config: dict | None = None,
                dist_checkpoint: str | None = None, dist_checkpoint_prefix: str = "", vision: bool = True):
    """The policy to train, in float32 on the CPU: lathe's decoder read straight from the checkpoint when it runs
    the architecture and nothing needs the transformers module (`impl` not `hf`, no transformers rollout, no
    config overrides); else the transformers model (`load_causal_lm`), which the trainer may still convert.
    A vision-language checkpoint loads as lathe's VL model; with `vision` false (a run without images) a Qwen3.5
    one loads as its language model alone (`lathe.models.vl.load_language_model`: lathe's text decoder, which
    saves the whole checkpoint back). A hub id is read from the hub's local cache (downloaded there first when
    online) when lathe's decoder runs it (`hub_snapshot`), as a local directory would be.

    Reading straight into lathe's decoder skips transformers' own copy of the weights: for a 7B model that is
    28 GiB of host memory and a full copy's time. A load that takes a while shows its progress
    (`lathe.track.phase`). `dist_checkpoint`: a Megatron distributed checkpoint holding the weights (verl's
    `megatron.use_dist_checkpointing`), read into lathe's decoder with `path`'s config.json (`load_dist_policy`)."""
    if dist_checkpoint is not None:
        with phase(f"loading the policy from the Megatron checkpoint {dist_checkpoint}",
                   done=f"loaded the policy from {dist_checkpoint}"):
            return load_dist_policy(path, dist_checkpoint, prefix=dist_checkpoint_prefix, impl=impl,
                                    needs_transformers=needs_transformers, override_config=override_config)
    with phase(f"loading the policy {path}", done=f"loaded the policy {path}"):
        return _load_policy(path, impl=impl, needs_transformers=needs_transformers,
                            trust_remote_code=trust_remote_code, vocab_size=vocab_size, seed=seed,
                            override_config=override_config, vision=vision)


def _load_policy(path: str, *, impl: str, needs_transformers: bool, trust_remote_code: bool, vocab_size: int | None,
                 seed: int, override_config: dict | None, vision: bool = True):
    if is_vl_path(path):
        from lathe.models.vl import language_model_runs_alone, load_language_model
        local = vl_checkpoint_dir(path)
        if vision or impl == "hf" or needs_transformers or override_config or not language_model_runs_alone(local):
            return load_vl_policy(local, impl=impl, override_config=override_config)
        model = load_language_model(local, torch.float32)
        log.info("model: no image prompts, so %s's language model runs alone (%s, lathe's text decoder); its "
                 "checkpoints hold the whole model, the vision tower as read", model.config.vl_checkpoint[1]
                 ["architectures"][0], model.config.architecture)
        model.generation_config = _generation_config(local)
        return model
    direct = impl != "hf" and not needs_transformers and not override_config and not is_builtin(path)
    local = direct_checkpoint_dir(path) if direct else None
    if local is not None:
        from lathe.models import load_lathe_model
        from lathe.models.config import UnsupportedArchitecture
        try:
            model = load_lathe_model(local, torch.float32)
        except UnsupportedArchitecture as e:     # tensors lathe's decoder does not know: transformers decides
            log.info("model: %s", e)
        else:
            model.generation_config = _generation_config(local)
            return model
    return load_causal_lm(path, trust_remote_code=trust_remote_code, vocab_size=vocab_size, seed=seed,
                          override_config=override_config)


def load_dist_policy(path: str, dist_checkpoint: str, *, prefix: str = "", impl: str = "auto",
                     needs_transformers: bool = False, override_config: dict | None = None):
    """lathe's decoder (float32, CPU) with the weights of the Megatron distributed checkpoint `dist_checkpoint` (keys
    after `prefix`) and the architecture of `path`'s config.json (`lathe.models.megatron_ckpt`); the weights then flow
    as Hugging Face ones do (the reference copies them, the rollout gets them by the usual sync). Only lathe's decoder
    reads them: anything that needs the transformers module fails here, naming the key to change."""
    key = "actor_rollout_ref.actor.megatron.dist_checkpointing_path"
    blocker = ("actor_rollout_ref.model.impl=hf" if impl == "hf" else
               "actor_rollout_ref.rollout.name=hf" if needs_transformers else
               f"actor_rollout_ref.model.override_config={override_config!r}" if override_config else None)
    if blocker is not None:
        raise ModelLoadError(f"{key}={dist_checkpoint!r}: a Megatron checkpoint loads into lathe's own decoder only, "
                             f"and {blocker} needs the transformers model. Fix: remove {blocker.partition('=')[0]}, "
                             "or convert the checkpoint to Hugging Face format and set actor_rollout_ref.model.path")
    from lathe.models.megatron_ckpt import MegatronCheckpointError
    from lathe.models import load_lathe_model
    from lathe.models.config import UnsupportedArchitecture
    local = _local_config_dir(path)
    try:
        model = load_lathe_model(local, torch.float32, dist_checkpoint=os.path.expanduser(str(dist_checkpoint)),
                                 dist_checkpoint_prefix=prefix)
    except (UnsupportedArchitecture, MegatronCheckpointError) as e:
        raise ModelLoadError(f"{key}={dist_checkpoint!r}: {e}".replace("; the transformers fallback will be used",
                                                                      "")) from None
    model.generation_config = _generation_config(local)
    return model


def _local_config_dir(path: str) -> str:
    """The local directory holding `path`'s config.json: `path` itself, or a hub id's copy in the local cache."""
    local = os.path.expanduser(str(path))
    if Path(local).is_dir():
        return local
    from huggingface_hub import snapshot_download
    return snapshot_download(str(path), allow_patterns=["*.json", "*.py", "*.model", "*.tiktoken", "*.txt"])


# a checkpoint's files lathe reads (weights, configs, tokenizer, chat template, processor), at the repository's top
# level only: some hold another copy of the weights in a folder (gpt-oss's original/), which is not downloaded
VL_FILES = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
SUBFOLDERS = ["*/*"]


def is_vl_path(path: str) -> bool:
    """Whether `path` (a checkpoint directory, `~` allowed, or a hub id: its config.json read from the local cache,
    downloaded there first when the hub is online; never a built-in model) holds a vision-language model."""
    from lathe.models.vl import is_vl_checkpoint
    if is_builtin(path):
        return False
    return is_vl_checkpoint(checkpoint_config_dir(str(path)))


@functools.lru_cache(maxsize=None)
def checkpoint_config_dir(path: str) -> str:
    """`path` (`~` expanded) when it is a directory, else a hub id's cached config directory, else `path` (not a
    checkpoint lathe finds: the loaders name it)."""
    local = os.path.expanduser(path)
    if Path(local).is_dir() or not HUB_ID.match(path):
        return local
    try:
        return _local_config_dir(path)
    except Exception:       # (unreachable, or offline and not cached: preflight's check_model names it)
        return local


def hub_snapshot(repo_id: str) -> str | None:
    """The local snapshot of hub id `repo_id` with the files lathe's decoder reads (`VL_FILES`: safetensors weights,
    configs, tokenizer), downloaded to the hub's cache first when online; None where the repository holds no
    safetensors weights (transformers then reads its other formats)."""
    from huggingface_hub import snapshot_download
    try:
        local = snapshot_download(repo_id, allow_patterns=VL_FILES, ignore_patterns=SUBFOLDERS)
    except Exception as err:
        log.info("model: %s could not be read from the hub's cache for lathe's decoder (%s: %s); transformers "
                 "loads it", repo_id, type(err).__name__, err)
        return None
    return local if any(Path(local).glob("*.safetensors")) else None


def direct_checkpoint_dir(path: str) -> str | None:
    """The local directory lathe's decoder reads `path` from directly: `path` itself (`~` expanded), or a hub id's
    copy in the local cache (`hub_snapshot`), when lathe's decoder runs its architecture; else None (transformers
    loads it)."""
    from lathe.models import supports
    local = os.path.expanduser(str(path))
    if not Path(local).is_dir() and HUB_ID.match(str(path)) and supports(checkpoint_config_dir(path))[0]:
        local = hub_snapshot(str(path)) or local
    return local if Path(local).is_dir() and supports(local)[0] else None


def vl_checkpoint_dir(path: str) -> str:
    """The local directory of the vision-language checkpoint `path`: itself, or a hub id's snapshot in the local
    cache (`VL_FILES`, downloaded there first when the hub is online), which lathe's VL model reads directly (the
    transformers fallback that hub ids take otherwise would read it as a text model)."""
    local = os.path.expanduser(str(path))
    if Path(local).is_dir():
        return local
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(str(path), allow_patterns=VL_FILES, ignore_patterns=SUBFOLDERS)
    except Exception as err:
        raise ModelLoadError(f"{path}: the vision-language checkpoint could not be read from the hub or its local "
                             f"cache ({type(err).__name__}: {err}). Fix: download it (`hf download {path}`) and set "
                             "the model path to that directory.") from err


def load_vl_policy(path: str, *, impl: str = "auto", override_config: dict | None = None):
    """A vision-language policy (Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint directory): lathe's VL model
    (`lathe.models.vl.load_lathe_vl_model`) in float32 on the CPU; the trainer has no transformers path for it."""
    key = "actor_rollout_ref.model"
    if impl == "hf":
        raise ModelLoadError(f"{key}.impl=hf: {path} is a vision-language checkpoint, which lathe trains with its own "
                             f"VL model only (transformers' VL modules take no packed batches here). Fix: set "
                             f"{key}.impl=auto (or lathe).")
    if override_config:
        raise ModelLoadError(f"{key}.override_config={override_config!r}: config overrides are not implemented for "
                             f"vision-language checkpoints ({path}). Fix: remove them, or edit the checkpoint's "
                             "config.json.")
    from lathe.models.vl import load_lathe_vl_model
    local = os.path.expanduser(str(path))
    model = load_lathe_vl_model(local, torch.float32)
    model.generation_config = _generation_config(local)
    return model


def _generation_config(path: str):
    """The checkpoint's generation_config.json (its eos ids end responses), or None."""
    if not (Path(path) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig
    return GenerationConfig.from_pretrained(path, local_files_only=True)


def build_builtin_model(shape: str, *, vocab_size: int | None, seed: int = 0, dtype=torch.float32):
    """A randomly initialised Qwen2-architecture model of a built-in shape (see `BUILTIN_SHAPES`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    if (err := unknown_builtin(BUILTIN_PREFIX + shape)) is not None:
        raise err
    tok = builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab_size or len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                      rope_theta=10000.0, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, attn_implementation="sdpa", **BUILTIN_SHAPES[shape])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return cast_keeping_rope(model, dtype)


def _explain(path: str, what: str, err: Exception) -> str:
    msg = f"could not load the {what} from {path!r}: {err}"
    if not Path(os.path.expanduser(str(path))).is_dir():
        msg += ("\nThis looks like a hub id, which needs network access to huggingface.co. If this machine is "
                "offline, download the checkpoint elsewhere and set actor_rollout_ref.model.path to its local "
                "directory (or set HF_HUB_OFFLINE=1 to use a copy already in the local cache).")
    if "trust_remote_code" in str(err):
        msg += "\nThe checkpoint ships its own code: set actor_rollout_ref.model.trust_remote_code=true if you trust it."
    return msg


def lathe_from_transformers(model, *, clone: bool = True):
    """lathe's decoder holding a copy of the weights of a transformers model, or `UnsupportedArchitecture`.

    A `*ForCausalLM` becomes a `LatheCausalLM`, a `*ForTokenClassification` (the critic) a `LatheValueModel`.
    Parameter names are the same on both sides, so this is a state-dict copy (cloned, not shared: the
    transformers module stays usable, e.g. as the rollout's copy) and the seeded initialisation is kept.
    `clone=False` shares the tensors instead (one copy of a model too large for two on its device; training either
    one then changes both).
    """
    from lathe.models.config import LatheConfig, UnsupportedArchitecture
    from lathe.models.decoder import LatheCausalLM, LatheValueModel
    from lathe.models.io import load_into
    name = type(model).__name__
    d = model.config.to_dict()
    d["architectures"] = [name]
    source = f"{name} ({getattr(model.config, '_name_or_path', '') or 'in memory'})"
    cfg = LatheConfig.from_hf_dict(d, source=source)
    if float(d.get("classifier_dropout") or 0.0) > 0.0:       # (the body's dropout: `LatheConfig`'s check)
        raise UnsupportedArchitecture(f"{source}: classifier_dropout={d['classifier_dropout']} (lathe's decoder has "
                                      "no dropout); the transformers fallback will be used")
    is_value = name.endswith("ForTokenClassification")
    state = {k: v.detach().clone() if clone else v.detach() for k, v in model.state_dict().items()}
    if is_value:
        if getattr(model.config, "num_labels", 1) != 1:
            raise UnsupportedArchitecture(f"{source}: num_labels={model.config.num_labels}; a critic has one "
                                          "output (num_labels=1); the transformers fallback will be used")
        cfg.tie_word_embeddings = False
        with torch.device("meta"):
            lathe = LatheValueModel(cfg, score_bias="score.bias" in state)
    else:
        with torch.device("meta"):
            lathe = LatheCausalLM(cfg)
    load_into(lathe, state, source)
    return lathe.train(model.training)


def select_impl(model, impl: str = "auto", *, role: str = "actor", key: str = "actor_rollout_ref.model.impl"):
    """The module the trainer runs for `model` (a transformers model), following `impl`; logs which.

    `auto`: lathe's decoder when it implements the architecture, else `model` itself; `lathe`: lathe's
    decoder or an error; `hf`: `model` itself. A lathe module holds its own copy of the weights; a module that
    already is lathe's decoder (loaded straight from a checkpoint) is returned as it is.
    """
    from lathe.models.config import UnsupportedArchitecture
    from lathe.models.decoder import LatheCausalLM, LatheValueModel
    from lathe.models.vl import LatheVLForConditionalGeneration
    name = type(model).__name__
    if impl not in IMPLS:
        raise ValueError(f"{key}={impl!r} is unknown; use one of {', '.join(IMPLS)}")
    if isinstance(model, LatheVLForConditionalGeneration):      # a vision-language checkpoint (`load_vl_policy`)
        if impl == "hf":
            raise ValueError(f"{key}=hf, but the {role} is a vision-language model, which lathe trains with its own "
                             f"VL model only; set {key}=auto")
        log.info("%s: lathe VL model (%s, %s layers)", role, model.config.architecture,
                 model.config.text.num_hidden_layers)
        return model
    if isinstance(model, (LatheCausalLM, LatheValueModel)):     # loaded straight into lathe's decoder
        if impl == "hf":
            raise ValueError(f"{key}=hf, but the {role} was loaded into lathe's decoder; load it with transformers")
        log.info("%s: lathe decoder (%s, %s layers)", role, model.config.architecture, model.config.num_hidden_layers)
        return model
    if impl == "hf":
        log.info("%s: transformers %s (%s=hf)", role, name, key)
        return model
    try:
        lathe = lathe_from_transformers(model)
    except UnsupportedArchitecture as e:
        if impl == "lathe":
            raise ValueError(f"{key}=lathe, but lathe's decoder cannot run {name}: {e}. Set {key}=auto (or hf) "
                             "to train it with transformers") from e
        log.info("%s: transformers %s (lathe's decoder does not implement it: %s). The cost: the rollout runs "
                 "transformers generate, about 15x slower than lathe's engine (0.5B, batch 256 on an H100: "
                 "bench/results/rollout_nvidia-h100-80gb-hbm3.json), and training runs its padded forward",
                 role, name, e)
        return model
    log.info("%s: lathe decoder (%s, %s layers)", role, lathe.config.architecture, lathe.config.num_hidden_layers)
    return lathe
