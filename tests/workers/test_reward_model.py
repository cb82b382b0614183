"""The reward-model part: its scores are transformers' sequence-classification forward of the rendered inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from helpers import RM_TEMPLATE, assert_close_rel, tiny_reward_model
from lathe.config import load_config
from lathe.data.builtin import builtin_tokenizer
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.workers.reward_model import RewardModelWorker

CHATS = [[{"role": "user", "content": "What is 2+3?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}],
         [{"role": "user", "content": "Name a prime."}]]
RESPONSES = ["5", "It is 42, since 7*6=42.", "2"]


def scored_batch(tok):
    """Three prompts (the policy's chat template) with ragged responses ending in EOS, one cut before it."""
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    responses[2] = responses[2][:-1]                                   # stopped by length: no EOS
    out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop", "stop", "length"])
    batch = to_batch(prompt_ids, out, tok.pad_token_id, n=1)
    batch["raw_prompt"] = CHATS
    return batch, prompt_ids, responses


def worker(path, *overrides, impl: str = "auto", device=torch.device("cpu")):
    cfg = load_config("default", ["reward_model.enable=true", f"reward_model.model.path={path}",
                                  "reward_model.micro_batch_size_per_gpu=2", "reward_model.max_length=512", *overrides])
    return RewardModelWorker(cfg, builtin_tokenizer(), device=device,
                             micro_batch_size=cfg.reward_model.micro_batch_size_per_gpu, impl=impl)


def hf_scores(path, inputs: list[list[int]]) -> torch.Tensor:
    """transformers' forward of each input alone (no padding): the logit of its last token."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([ids])).logits[0, 0] for ids in inputs])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return tiny_reward_model(root / "same"), tiny_reward_model(root / "own", chat_template=RM_TEMPLATE, seed=1)


def test_same_tokenizer_scores_the_policy_tokens_as_they_are(models):
    tok = builtin_tokenizer()
    batch, prompt_ids, responses = scored_batch(tok)
    rm = worker(models[0])
    assert not rm.switch_template
    scores = rm.compute_rm_score(batch)["rm_scores"]
    expected = hf_scores(models[0], [p + r for p, r in zip(prompt_ids, responses)])
    assert_close_rel(scores, expected, rel=1e-5)
    assert scores.std() > 0.01                               # the rows do score differently


def test_another_chat_template_re_renders_each_conversation(models):
    """verl's `_switch_chat_template`: the prompt's messages and the response (EOS text removed) in the reward
    model's own template, tokenized by its tokenizer."""
    tok = builtin_tokenizer()
    batch, _, _ = scored_batch(tok)
    rm = worker(models[1])
    assert rm.switch_template
    texts = [rm.tokenizer.apply_chat_template(c + [{"role": "assistant", "content": r}],
                                             tokenize=False) for c, r in zip(CHATS, RESPONSES)]
    assert rm.render(batch) == texts
    assert texts[0] == "USER: What is 2+3?\nASSISTANT: 5\n"
    expected = hf_scores(models[1], [rm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    assert_close_rel(rm.compute_rm_score(batch)["rm_scores"], expected, rel=1e-5)


def test_max_length_keeps_the_first_tokens_and_micro_batches_do_not_change_scores(models):
    tok = builtin_tokenizer()
    batch, prompt_ids, responses = scored_batch(tok)
    cut = worker(models[0], "reward_model.max_length=9", "reward_model.micro_batch_size_per_gpu=1")
    expected = hf_scores(models[0], [(p + r)[:9] for p, r in zip(prompt_ids, responses)])
    assert_close_rel(cut.compute_rm_score(batch)["rm_scores"], expected, rel=1e-5)
    packed = worker(models[0], "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=4096",
                    "reward_model.model.fsdp_config.param_offload=true")
    assert_close_rel(packed.compute_rm_score(batch)["rm_scores"],
                     worker(models[0]).compute_rm_score(batch)["rm_scores"], rel=1e-5)
    assert next(packed.model.parameters()).device.type == "cpu"


def test_keys_are_checked_before_loading(tmp_path):
    from lathe.config.errors import ConfigError
    with pytest.raises(ConfigError, match="reward_model.model.path"):
        load_config("default", ["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=2"])
    with pytest.raises(ConfigError, match="reward_model.micro_batch_size_per_gpu=0"):
        load_config("default", ["reward_model.enable=true", f"reward_model.model.path={tmp_path}",
                                "reward_model.micro_batch_size_per_gpu=0"])
    with pytest.raises(ConfigError, match="filter_groups.enable`=true with `reward_model.enable`=true in fully-async"):
        load_config("fully_async", ["reward_model.enable=true", f"reward_model.model.path={tmp_path}",
                                    "algorithm.filter_groups.enable=true"])      # (alone it runs: the trainer scores)
    with pytest.raises(ConfigError, match="reward_model.model.input_tokenizer"):
        load_config("default", ["reward_model.enable=true", f"reward_model.model.path={tmp_path}",
                                "reward_model.micro_batch_size_per_gpu=2", "reward_model.model.input_tokenizer=x/y"])
    cfg = load_config("default", ["reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}",
                                  "reward_model.micro_batch_size_per_gpu=2"])       # verl's newer spelling
    assert cfg.reward_model.enable and cfg.reward_model.model.path == str(tmp_path)
    from lathe.loop.preflight import preflight
    with pytest.raises(ValueError, match="reward_model.model.path"):
        preflight(cfg)                                       # no config.json there: fails before torch loads it


def test_image_prompts_are_refused_naming_the_key(models):
    batch, _, _ = scored_batch(builtin_tokenizer())
    batch["multi_modal_inputs"] = [None, {"pixel_values": torch.zeros(1, 4)}, None]
    with pytest.raises(NotImplementedError, match="reward_model.enable=true with image prompts"):
        worker(models[0]).compute_rm_score(batch)
