"""What `lathe train` and `lathe sft` check before anything loads, once the config itself is valid.

Everything knowable from the config and the file system without loading a model or reading a data set: the model
and tokenizer paths (`lathe.models.paths`); each data file and the columns its rows need (a parquet file's schema, a
JSON-lines file's first row: `lathe.data.files.peek`); a built-in scorer for every data_source (that column read
alone from a parquet file) when no reward function is given; the teachers' checkpoints and tokenizers, and with
several teachers one for every training data_source (on-policy distillation); the checkpoint `trainer.resume_mode` names
(`lathe.ckpt.resume`); the custom reward function (imported here, once: the run reuses it); a custom dataset class
(`data.custom_cls`: its file imported and the class found; the files it reads are its own business, so they are not
peeked at). Neither torch nor transformers is imported here (a reward or dataset file may import them itself), so `lathe train` runs this before importing
them and a mistake costs about a second, not the start-up. The checks raise the errors the loaders raise when they
meet the problem later (one source for each message); every problem found is reported, each naming its key, the file
and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lathe.ckpt.resume import check_lora, resume_point
from lathe.config import critic_in_use
from lathe.config.distill import teachers
from lathe.config.errors import ConfigError, join_problems
from lathe.config.rules_reward import is_batch_manager, reward_fn_kwargs
from lathe.data import dataset, sft
from lathe.data.custom import load_dataset_class
from lathe.data.files import Columns, column_values, data_files, peek
from lathe.models import supports
from lathe.models.megatron_ckpt import check_dist_checkpoint
from lathe.config.verl_translate import DIST_KEY, dist_checkpoint
from lathe.models.paths import ModelLoadError, check_model, check_tokenizer, is_builtin, resolve
from lathe.reward import load_reward_fn
from lathe.reward.registry import scorer_for

# The problems a user can fix: one is raised as it is; several become one ConfigError listing them.
_FIXABLE = (ValueError, FileNotFoundError, NotImplementedError)


@dataclass
class Checked:
    """What the checks loaded, for the run to reuse: the reward function (`load_custom_reward`)."""

    reward_fn: Callable


class _Problems:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        """Record a fixable error raised in the block and go on with the next check."""
        try:
            yield
        except _FIXABLE as e:
            self.errors.append(e)

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigError(join_problems([str(e) for e in self.errors], "problems found before loading anything"))


def preflight(cfg, *, found: Sequence[BaseException] = ()) -> Checked:
    """`lathe train`'s checks of `cfg` (a validated LatheConfig); raises what it finds, with the problems its caller
    `found` already, else returns what it loaded."""
    problems = _Problems()
    problems.errors.extend(found)
    m, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    _check_paths(problems, [(check_model, "actor_rollout_ref.model.path", m.path),
                            (check_tokenizer, "actor_rollout_ref.model.tokenizer_path" if m.tokenizer_path else
                             "actor_rollout_ref.model.path (its tokenizer: model.tokenizer_path is unset)",
                             m.tokenizer_path or m.path),
                            (check_model, "critic.model.path", critic.path if critic_in_use(cfg) else None),
                            (check_judge_model if cfg.reward_model.judge.enable else check_reward_model,
                             "reward_model.model.path", cfg.reward_model.model.path if cfg.reward_model.enable
                             else None)])
    if (dist := dist_checkpoint(cfg)) is not None:   # verl's megatron.use_dist_checkpointing: the starting weights
        with problems.check():
            check_dist_checkpoint(dist, f"{DIST_KEY} (with use_dist_checkpointing=true)")
    teacher_list = teachers(cfg) if cfg.distillation.enabled else []
    _check_paths(problems, [(check, f"distillation.teacher_models.{t.name}.model_path", t.model_path)
                            for t in teacher_list for check in (check_model, check_tokenizer)])
    custom = bool(cfg.reward.custom_reward_function.path)

    def check_file(key: str, cols: Columns) -> None:
        dataset.check_columns(cols, cfg.data.prompt_key, key, cfg.data.reward_fn_key)
        if not custom:                  # the built-in scorers: one for every data_source (data.reward_fn_key's column)
            _check_scorers(f"{cols.src} ({key})", column_values(cols, cfg.data.reward_fn_key))
        if len(teacher_list) > 1 and key == "data.train_files":       # each training row needs its teacher
            _check_teachers(f"{cols.src} ({key})", column_values(cols, "data_source"), teacher_list)

    if cfg.data.custom_cls.path:        # a user's dataset class reads the files in its own schema: import it here
        with problems.check():
            load_dataset_class(cfg.data.custom_cls.path, cfg.data.custom_cls.name)
    else:
        _check_data(problems, cfg.data, ("train", "val"), check_file)
    with problems.check():
        path = resume_point(cfg.trainer)
        if path is not None:
            roles = {"actor": ("actor_rollout_ref.model.lora_rank", cfg.actor_rollout_ref.model.lora_rank)}
            if critic_in_use(cfg):
                roles["critic"] = ("critic.model.lora_rank", cfg.critic.model.lora_rank)
            check_lora(path, roles)
    reward_fn = None
    with problems.check():
        reward_fn = load_custom_reward(cfg)
    problems.raise_if_any()
    return Checked(reward_fn=reward_fn)


def check_reward_model(path: str, key: str) -> None:
    """A reward model is a sequence-classification checkpoint: a directory with config.json, or a cached hub id."""
    if is_builtin(path):
        raise ModelLoadError(f"{key}={path}: a reward model is a sequence-classification checkpoint (a directory or a "
                             "hub id), not a built-in shape. Fix: point it at such a checkpoint")
    check_model(path, key)


def check_judge_model(path: str, key: str) -> None:
    """A generative judge is a causal-LM checkpoint lathe's decoder runs, with its tokenizer."""
    if is_builtin(path):
        raise ModelLoadError(f"{key}={path}: a judge (reward_model.judge.enable) is a causal-LM checkpoint (a "
                             "directory or a hub id) with its own tokenizer, not a built-in shape. Fix: point it at "
                             "such a checkpoint")
    check_model(path, key)
    check_tokenizer(path, key)
    local = resolve(path, key)
    if Path(local).is_dir():
        ok, why = supports(local)
        if not ok:
            raise ModelLoadError(f"{key}={path}: the judge runs on lathe's engine, which runs lathe's decoder only "
                                 f"({why}). Fix: use a causal LM lathe implements (Llama, Qwen2/2.5, Qwen3, "
                                 "Qwen3-MoE) as the judge")


def preflight_sft(cfg) -> None:
    """`lathe sft`'s checks of `cfg` (a validated SFT config): the model and tokenizer paths, the data files and
    their columns, the resume point."""
    problems = _Problems()
    _check_paths(problems, [(check_model, "model.path", cfg.model.path),
                            (check_tokenizer, "model.tokenizer_path", cfg.model.tokenizer_path)])
    _check_data(problems, cfg.data, ("train", "test"), lambda key, cols: sft.check_columns(cols, cfg.data, key))
    with problems.check():
        resume_point(cfg.trainer)
    problems.raise_if_any()


def load_custom_reward(cfg) -> Callable:
    """`reward.custom_reward_function`'s function (imported from its file, a batch function with
    `reward_model.reward_manager=batch`) with its keyword arguments, or the built-in scorers; its errors as one
    ValueError (their messages name the keys, the file and the fix)."""
    fn_cfg = cfg.reward.custom_reward_function
    try:
        return load_reward_fn(fn_cfg.path, fn_cfg.name, reward_fn_kwargs(cfg), batch=is_batch_manager(cfg))
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(str(e)) from e


def _check_paths(problems: _Problems, paths: list[tuple[Callable[[str, str], None], str, str | None]]) -> None:
    """`check(path, key)` for each (check, key, path) whose path is set, once per check and path."""
    seen = set()
    for check, key, path in paths:
        if path is not None and (check, path) not in seen:
            seen.add((check, path))
            with problems.check():
                check(path, key)


def _check_data(problems: _Problems, data_cfg, splits: tuple[str, str],
                check: Callable[[str, Columns], None]) -> None:
    """`check(key, what the file holds)` (see `peek`) for each file of `data.train_files` and `data.val_files` (when
    set; a builtin's rows as `splits`), recording what it raises, and what reading the file raises."""
    for key, files, split in (("data.train_files", data_cfg.train_files, splits[0]),
                              ("data.val_files", data_cfg.val_files, splits[1])):
        if not files and key == "data.val_files":     # no validation set
            continue
        with problems.check():
            for path in data_files(files):
                with problems.check():
                    if (cols := peek(path, split, key)) is not None:
                        check(key, cols)


def _check_teachers(origin: str, data_sources: set[str], teacher_list) -> None:
    """With several teachers every data_source of the training rows is some teacher's key."""
    keys = sorted(t.key for t in teacher_list)
    missing = sorted(str(s) for s in data_sources if str(s) not in keys)
    if missing:
        raise ValueError(f"{origin}: rows with data_source {missing} have no teacher (distillation.teacher_models "
                         f"keys: {keys}). Fix: add a teacher per data_source (+distillation.teacher_models.<name>."
                         "{key,model_path}), or use one teacher for every row.")


def _check_scorers(origin: str, data_sources: set[str]) -> None:
    """Without a custom reward function every data_source needs a built-in scorer (`scorer_for`'s error, with
    the file that holds it)."""
    for name in sorted(data_sources):
        try:
            scorer_for(name)
        except NotImplementedError as e:
            raise NotImplementedError(f"{origin}: {e}") from None
