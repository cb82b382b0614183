"""The reward model on lathe's decoder: packed micro-batches score as transformers' sequence-classification forward."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import RM_TEMPLATE, assert_close_rel, tiny_reward_model
from lathe.data.builtin import builtin_tokenizer
from lathe.generation import RolloutOutput
from lathe.models.config import UnsupportedArchitecture
from lathe.models.decoder import LatheValueModel
from lathe.models.reward import lathe_reward_model
from lathe.rollout.base import to_batch
from lathe.workers.reward_model import load_reward_model, score_rows, select_reward_impl
from workers.test_reward_model import hf_scores, worker

CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to twenty in words."}],
         [{"role": "user", "content": "2+2?"}],
         [{"role": "user", "content": "Say why, at length."}]]
RESPONSES = ["4", "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen", "",
             "Because " + "it is so, and it was so, " * 5]


def ragged_batch(tok):
    """Rows of very different lengths (an empty response, one of ~150 tokens), responses ending in EOS."""
    prompt_ids = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for c in CHATS]
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * len(responses))
    batch = to_batch(prompt_ids, out, tok.pad_token_id, n=1)
    batch["raw_prompt"] = CHATS
    return batch


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_scores_equal_transformers_forward(tmp_path, family, caplog):
    """The reward model's own chat template (not the policy's): each conversation is re-rendered, then scored in
    packed micro-batches by token budget, several rows to a forward; transformers scores each text alone."""
    path = tiny_reward_model(tmp_path / family, chat_template=RM_TEMPLATE, seed=2, family=family)
    batch = ragged_batch(builtin_tokenizer())
    with caplog.at_level(logging.INFO, logger="lathe"):
        rm = worker(path, "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=256",
                    "reward_model.max_length=256")
    assert rm.switch_template and rm.packed and isinstance(rm.model, LatheValueModel)
    assert "lathe decoder" in caplog.text and "packed micro-batches" in caplog.text
    inputs = rm.rm_inputs(batch)
    lengths = [len(x) for x in inputs]
    assert max(lengths) > 6 * min(lengths) and max(lengths) < 256         # (not cut)
    assert any(len(rows) > 1 for rows in rm.micro_batches(lengths))         # rows do share a packed forward
    scores = rm.compute_rm_score(batch)["rm_scores"]
    expected = hf_scores(path, inputs)
    assert_close_rel(scores, expected, rel=1e-5)
    assert scores.std() > 0.01
    padded = worker(path, "reward_model.micro_batch_size_per_gpu=4").compute_rm_score(batch)["rm_scores"]
    assert_close_rel(padded, expected, rel=1e-5)                              # fixed-size packed micro-batches


def test_the_transformers_path_stays_for_what_lathe_does_not_run(tmp_path):
    from transformers import Phi3Config, Phi3ForSequenceClassification
    path = tiny_reward_model(tmp_path / "llama")
    rm = worker(path, impl="hf")
    assert not rm.packed and "impl=hf" in rm.impl
    batch = ragged_batch(builtin_tokenizer())
    assert_close_rel(rm.compute_rm_score(batch)["rm_scores"], hf_scores(path, rm.rm_inputs(batch)), rel=1e-5)

    phi3 = Phi3ForSequenceClassification(Phi3Config(           # (Mistral's reward models run on lathe's decoder)
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=0)).eval()
    model, packed, why = select_reward_impl(phi3)
    assert model is phi3 and not packed and "does not implement Phi3ForSequenceClassification" in why
    with pytest.raises(UnsupportedArchitecture):
        select_reward_impl(phi3, "lathe")


def test_a_head_lathe_does_not_read_is_refused(tmp_path):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model(tmp_path / "rm"), num_labels=1)
    model.score = torch.nn.Linear(model.config.hidden_size, 1, bias=True)
    with pytest.raises(UnsupportedArchitecture, match="with a bias"):
        lathe_reward_model(model)


def peaked_reward_model(path) -> str:
    """A small random `Qwen2ForSequenceClassification` saved in `path`, its q/k projections 10x the default init so
    that attention is peaked and RoPE's angles decide the scores (at the default init a small model's attention
    logits are ~0: softmax uniform, any rotation error invisible)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, num_labels=1, pad_token_id=0))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.2)
            layer.self_attn.k_proj.weight.normal_(0, 0.2)
    model.save_pretrained(path)
    return str(path)


def test_bf16_scores_lie_as_near_float32_as_transformers_bf16(tmp_path):
    """Issue 46: in bf16, lathe's packed scores are no further from the float32 forward's than transformers' bf16
    padded forward's, both loaded as the worker loads them (`from_pretrained(dtype=bfloat16)`: RoPE frequencies
    float32). The 4x gap the bench measured on a GPU came from its model instead: `.to(bfloat16)` rounds
    transformers' RoPE frequency buffers, `.float()` keeps them rounded, so its bf16 forward and the float32
    reference made from it shared a model that lathe's decoder (float32 frequencies) is not; measured so, lathe's
    scores look several times further than transformers', as here."""
    path = peaked_reward_model(tmp_path / "rm")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (120, 380, 250, 300)]
    parts, cpu = [[0, 1], [2, 3]], torch.device("cpu")
    scores = lambda model, packed=False: score_rows(model, packed, rows, parts, cpu, 0).double()  # noqa: E731
    rel = lambda got, ref: ((got - ref).norm() / ref.norm()).item()                          # noqa: E731

    exact = scores(load_reward_model(path, dtype=torch.float32))
    hf = load_reward_model(path, dtype=torch.bfloat16)
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    hf_bf16 = scores(hf)
    lathe_bf16 = scores(*select_reward_impl(hf, "lathe")[:2])
    assert 1e-3 < rel(hf_bf16, exact) < 0.2
    assert rel(lathe_bf16, exact) <= 1.5 * rel(hf_bf16, exact)

    rounded = load_reward_model(path, dtype=torch.float32).to(torch.bfloat16)      # the bench's model until then
    assert rounded.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    rounded_bf16 = scores(rounded)
    rounded_ref = scores(rounded.float())
    assert rel(lathe_bf16, rounded_ref) > 2 * rel(rounded_bf16, rounded_ref)


@pytest.mark.gpu
def test_cuda_scores_packed_in_bf16_with_varlen_attention(tmp_path):
    """On a GPU: bf16 weights, flash-attention varlen over the packed rows; the scores are transformers' padded bf16
    forward's and the float32 forward's up to bf16 rounding."""
    path = tiny_reward_model(tmp_path / "qwen2", chat_template=RM_TEMPLATE, seed=2, family="qwen2")
    batch = ragged_batch(builtin_tokenizer())
    cuda = torch.device("cuda")
    rm = worker(path, "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=256",
                "reward_model.max_length=256", device=cuda)
    assert rm.packed and rm.model.dtype == torch.bfloat16 and rm.model.packed_backend() == "varlen"
    scores = rm.compute_rm_score(batch)["rm_scores"]
    expected = hf_scores(path, rm.rm_inputs(batch))
    assert_close_rel(scores, expected, rel=3e-2)
    hf = worker(path, "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=256",
                "reward_model.max_length=256", device=cuda, impl="hf")
    assert_close_rel(scores, hf.compute_rm_score(batch)["rm_scores"], rel=3e-2)
