"""`lathe sft`: the loss against an independent computation with transformers, the same update however the batch
is cut into micro-batches or dealt to ranks, an exact resume, verl's keys and metric names, and a checkpoint that
`lathe train` starts from."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from helpers import assert_close_rel
from lathe.cli import main
from lathe.config import ConfigError
from lathe.config.sft import load_sft_config
from lathe.data.builtin import builtin_tokenizer
from lathe.data.sft import SFTDataset
from lathe.loop.sft import collate
from lathe.models.hf import load_policy
from lathe.workers.sft import SFTWorker

FAST = ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.val_max_samples=16",
        "optim.lr=3e-3", "trainer.logger=[console]"]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft(run_dir, *overrides: str) -> list[dict]:
    assert main(["sft", f"trainer.default_local_dir={run_dir}", *FAST, *overrides]) == 0
    return rows(run_dir)


def test_the_default_learns_and_lathe_train_starts_from_its_checkpoint(tmp_path, capfd):
    out = sft(tmp_path / "sft", "trainer.total_training_steps=16", "trainer.test_freq=8")
    assert [r["step"] for r in out] == list(range(1, 17))
    assert {"train/loss", "train/grad_norm", "train/lr", "train/global_tokens", "train/total_tokens(B)"} <= set(out[0])
    assert [r["step"] for r in out if "val/loss" in r] == [8, 16] and out[15]["val/loss"] < out[7]["val/loss"]
    assert sum(r["train/loss"] for r in out[-4:]) < 0.6 * sum(r["train/loss"] for r in out[:4])
    assert out[0]["train/lr"] < out[1]["train/lr"]                     # verl's SFT default: warm-up, then cosine
    model = tmp_path / "sft" / "global_step_16" / "actor" / "huggingface"
    assert main(["train", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.warm_start.steps=0",
                 "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[console]",
                 "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 f"trainer.default_local_dir={tmp_path / 'rl'}"]) == 0
    assert rows(tmp_path / "rl")[0]["response_length/mean"] < 8        # the answers' format, not random tokens
    printed = "".join(capfd.readouterr())                  # the commands' output, redirected as into a log file
    assert re.search(r"^\d\d:\d\d:\d\d step 15/16 \| loss .* \| eta \S+$", printed, re.M), printed
    assert "\x1b" not in printed and "\r" not in printed   # no colour codes, no redrawn live line


def test_lora_sft_starts_at_the_base_models_loss_learns_and_saves_a_peft_adapter(tmp_path):
    full = sft(tmp_path / "full", "trainer.total_training_steps=1", "data.val_files=null")
    lora = sft(tmp_path / "lora", "trainer.total_training_steps=8", "data.val_files=null", "model.lora_rank=16",
               "model.lora_alpha=32", "optim.lr=1e-2")
    assert lora[0]["train/loss"] == pytest.approx(full[0]["train/loss"], rel=1e-6), "B = 0: the base model's loss"
    assert lora[-1]["train/loss"] < 0.8 * lora[0]["train/loss"]
    actor = tmp_path / "lora" / "global_step_8" / "actor"
    assert (actor / "lora_adapter" / "adapter_model.safetensors").exists()
    assert (actor / "huggingface" / "model.safetensors").exists()       # the merged model: lathe train starts from it


def test_resume_continues_exactly(tmp_path):
    run = tmp_path / "run"
    first = sft(run, "trainer.total_training_steps=4", "trainer.save_freq=2", "data.val_files=null")
    weights = (run / "global_step_4" / "actor" / "huggingface" / "model.safetensors").read_bytes()
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    again = sft(run, "trainer.total_training_steps=4", "trainer.save_freq=2", "data.val_files=null")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(first[2:], again[2:]):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
    assert (run / "global_step_4" / "actor" / "huggingface" / "model.safetensors").read_bytes() == weights


def test_after_each_epoch_saves_and_validates_at_each_epochs_end(tmp_path):
    """verl's sft_trainer takes trainer.save_freq / test_freq=after_each_epoch: an epoch's steps (3 here)."""
    run = tmp_path / "run"
    out = sft(run, "data.train_max_samples=24", "trainer.total_epochs=2", "trainer.save_freq=after_each_epoch",
              "trainer.test_freq=after_each_epoch", "trainer.max_ckpt_to_keep=null")
    assert [r["step"] for r in out if "val/loss" in r] == [3, 6]
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_3", "global_step_6"]


def test_verls_optimizer_keys_act_in_lathe_sft(tmp_path, setup, capsys):
    tok, cfg, _, model = setup
    cfg = copy.deepcopy(cfg)
    cfg.optim.optimizer, cfg.optim.override_optimizer_config = "SGD", {"momentum": 0.9, "nesterov": True}
    worker = SFTWorker(cfg, copy.deepcopy(model), tok, total_steps=4, device=torch.device("cpu"))
    assert type(worker.optimizer) is torch.optim.SGD and worker.optimizer.param_groups[0]["nesterov"]
    out = sft(tmp_path / "sgd", "trainer.total_training_steps=8", "data.val_files=null", "optim.optimizer=SGD",
              "+optim.override_optimizer_config.momentum=0.9", "optim.lr=0.1")
    assert sum(r["train/loss"] for r in out[-2:]) < 0.8 * sum(r["train/loss"] for r in out[:2])
    capsys.readouterr()
    assert main(["sft", f"trainer.default_local_dir={tmp_path / 'bad'}", *FAST, "optim.optimizer=Sgd2"]) != 0
    assert "`optim.optimizer`=Sgd2: torch.optim has no such class. Did you mean `SGD`" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "global_step_1").exists()


@pytest.fixture(scope="module")
def setup():
    tok = builtin_tokenizer()
    cfg = load_sft_config(None, ["optim.lr=1e-2", "optim.lr_warmup_steps_ratio=0"])
    examples = list(SFTDataset("builtin:arithmetic", tok, cfg.data, max_samples=6))
    return tok, cfg, examples, load_policy("builtin:tiny", vocab_size=len(tok), seed=3)


def updated(setup, *overrides: str) -> tuple[float, dict]:
    tok, cfg, examples, model = setup
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, value = item.split("=")
        setattr(cfg.data, key, type(getattr(cfg.data, key))(int(value) if value.isdigit() else value == "true"))
    worker = SFTWorker(cfg, copy.deepcopy(model), tok, total_steps=4, device=torch.device("cpu"))
    loss = worker.train_step(collate(examples, tok.pad_token_id))["train/loss"]
    return loss, {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def test_the_loss_is_transformers_mean_nll_over_trained_tokens_whatever_the_micro_batches(setup):
    tok, _, examples, model = setup
    nll, count = 0.0, 0
    with torch.no_grad():
        for e in examples:                    # one unpadded sequence at a time, transformers' own forward
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            logits = model(ids).logits[0, len(e.prompt_ids) - 1:-1].double()
            token_nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(e.response_ids)[:, None])[:, 0]
            nll += float((token_nll * torch.tensor(e.loss_mask)).sum())
            count += sum(e.loss_mask)
    whole, after = updated(setup, "micro_batch_size_per_gpu=6")
    assert_close_rel(whole, nll / count, rel=1e-5, name="train/loss")
    for cut in (["micro_batch_size_per_gpu=1"], ["micro_batch_size_per_gpu=4"],
                ["use_dynamic_bsz=true", "max_token_len_per_gpu=20"]):
        loss, weights = updated(setup, *cut)
        assert_close_rel(loss, whole, rel=1e-6, name=f"loss {cut}")
        assert_close_rel(weights, after, rel=3e-5, name=f"weights {cut}")


def test_recomputing_only_the_first_layer_gives_the_same_step(setup):
    tok, cfg, examples, model = setup
    whole, after = updated(setup, "micro_batch_size_per_gpu=6")
    cfg = copy.deepcopy(cfg)
    cfg.data.micro_batch_size_per_gpu, cfg.model.gradient_checkpointing_layers = 6, 1
    worker = SFTWorker(cfg, copy.deepcopy(model), tok, total_steps=4, device=torch.device("cpu"))
    assert worker.model.model.gradient_checkpointing_layers == 1
    loss = worker.train_step(collate(examples, tok.pad_token_id))["train/loss"]
    assert_close_rel(loss, whole, rel=1e-6, name="loss")
    assert_close_rel({k: v.detach() for k, v in worker.model.state_dict().items()}, after, rel=3e-5, name="weights")


def test_a_vision_language_model_recomputes_as_its_keys_say(setup):
    """lathe's VL model is lathe's decoder too (its language model's layers recompute), not a transformers model."""
    pytest.importorskip("transformers")
    from lathe.models.vl.config import VLConfig
    from lathe.models.vl.model import LatheVLForConditionalGeneration
    from models.vl_tiny import hf_config
    tok, cfg, _, _ = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.gradient_checkpointing_layers = 1
    model = LatheVLForConditionalGeneration(VLConfig.from_hf_dict(hf_config("qwen3_vl").to_dict()))
    worker = SFTWorker(cfg, model, tok, total_steps=4, device=torch.device("cpu"))
    stack = worker.model.model.language_model
    assert stack.gradient_checkpointing and stack.gradient_checkpointing_layers == 1


def test_verls_older_spellings_act_and_unimplemented_keys_fail_up_front():
    cfg = load_sft_config(None, ["model.partial_pretrain=/m", "optim.warmup_steps_ratio=0.3",
                                 "optim.lr_scheduler=constant", "data.multiturn.messages_key=conv",
                                 "use_remove_padding=true", "data.micro_batch_size=8", "trainer.n_gpus_per_node=2",
                                 "data.train_batch_size=16"])
    assert (cfg.model.path, cfg.optim.lr_warmup_steps_ratio, cfg.optim.lr_scheduler_type) == ("/m", 0.3, "constant")
    assert (cfg.data.messages_key, cfg.model.use_remove_padding, cfg.data.micro_batch_size_per_gpu) == ("conv", True, 4)
    assert load_sft_config(None, ["model.lora_rank=8", "trainer.n_gpus_per_node=2"]).model.lora_rank == 8
    with pytest.raises(ConfigError) as err:
        load_sft_config(None, ["model.lora_rank=8", "ulysses_sequence_parallel_size=2", "data.train_batch_size=7",
                               "trainer.n_gpus_per_node=2"])
    for part in ("2 config problems", "sequence parallelism",
                 "data.train_batch_size=7 is not divisible by the 2 devices"):
        assert part in str(err.value), part
    assert "lora_rank" not in str(err.value)
    with pytest.raises(ConfigError, match=r"Did you mean `data.prompt_key`"):
        load_sft_config(None, ["data.prompt_kye=q"])
    with pytest.warns(UserWarning, match=r"data.num_workers`=2 has no effect"):
        load_sft_config(None, ["data.num_workers=2"])


def test_print_config_reads_a_verl_style_yaml(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text("data:\n  prompt_key: question\n  response_key: answer\n  response_dict_keys: null\n"
                    "model:\n  partial_pretrain: /models/x\ntrainer:\n  total_epochs: 2\n")
    assert main(["sft", str(path), "--print-config", "trainer.total_epochs=3"]) == 0
    printed = capsys.readouterr().out
    assert "prompt_key: question" in printed and "path: /models/x" in printed and "total_epochs: 3" in printed


def test_every_sft_key_is_read_or_registered():
    """A key that is accepted must act: each leaf of the SFT schema is read (by name) in the code that `lathe sft`
    runs, or is in the registry of keys that are refused or warned about (config/sft.py `entries`)."""
    import dataclasses
    import re
    from pathlib import Path

    from lathe.config.schema_sft import SFTConfig
    from lathe.config.sft import entries
    src = Path(__file__).resolve().parents[2] / "src" / "lathe"
    modules = ["loop/sft.py", "data/sft.py", "workers/sft.py", "train/sft.py", "config/sft.py", "config/rules_optim.py",
               "train/precision.py",
               "train/optim.py", "train/offload.py", "train/parallel.py", "ckpt/checkpoint.py", "cluster/placement.py", "cluster/__init__.py",
               "track/tracker.py", "data/loader.py"]
    code = "\n".join((src / m).read_text() for m in modules)
    registered = {e.key for e in entries()}
    same_either_way = {"data.pad_mode", "model.use_remove_padding", "use_remove_padding", "data.custom_cls.name",
                       "model.fsdp_config.mixed_precision.buffer_dtype", "model.fsdp_config.use_torch_compile"}

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(sub):
                yield from leaves(type(sub), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"
    unread = [k for k in leaves(SFTConfig) if k not in registered | same_either_way
              and not re.search(rf"\.{re.escape(k.rsplit('.', 1)[-1])}\b|\"{re.escape(k.rsplit('.', 1)[-1])}\"", code)]
    assert unread == [], f"accepted but never read, and not registered: {unread}"
