"""Mistral (verl's Mistral-Nemo script) and Seed-OSS (verl's Seed-OSS-36B script) in lathe's decoder, against
transformers: logits on ragged batches, packed == padded, saves transformers reads back as the same class, the
engine's greedy tokens and log-probs, the critic's values; a config with dropout runs in transformers unless
override_config zeroes it (lathe's decoder has none)."""

import json

import pytest
import torch

from lathe.models import load_lathe_model, load_lathe_value_model, supports
from lathe.models.decoder import LatheCausalLM
from lathe.models.io import save_pretrained
from lathe.models.packing import pack_padded, unpack_to_padded

from helpers import assert_close_rel

from .lathe_tiny import LLAMA_LIKE, VOCAB, ragged_batch, save_hf
from .moe_reference import assert_engine_equals_transformers

ARCH = {"mistral": "MistralForCausalLM", "mistral_window": "MistralForCausalLM", "seed_oss": "SeedOssForCausalLM"}


@pytest.fixture(scope="module", params=LLAMA_LIKE)
def pair(request, tmp_path_factory):
    path, hf = save_hf(tmp_path_factory.mktemp("ckpt"), request.param)
    return request.param, path, hf, load_lathe_model(path).eval()


def test_the_config_reads_as_transformers_builds_it(pair):
    family, _, hf, lathe = pair
    cfg = lathe.config
    assert cfg.architecture == ARCH[family]
    attn = hf.model.layers[0].self_attn
    assert cfg.qkv_bias == (attn.q_proj.bias is not None) and cfg.o_bias == (attn.o_proj.bias is not None)
    assert cfg.qkv_bias == (family == "seed_oss") and not cfg.o_bias
    assert cfg.window_of(0) == (5 if family == "mistral_window" else None)


@pytest.mark.parametrize("mode", ["mask", "unpad"])
def test_logits_equal_transformers_on_ragged_batches_and_packed(pair, mode):
    family, _, hf, lathe = pair
    lathe.padded_attention = mode
    ids, mask, pos = ragged_batch(0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        out = lathe(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        p = pack_padded(ids, mask, pos)
        flat = lathe.forward_packed(p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen, return_hidden=False)
    real = mask.bool()
    assert_close_rel(out[real], ref[real], name=f"{family} padded logits")
    assert_close_rel(unpack_to_padded(flat, p)[real], ref[real], name=f"{family} packed logits")
    if family == "mistral_window":      # the window acts: the same rows with full attention differ
        hf.config.sliding_window = None
        try:
            with torch.no_grad():
                full = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        finally:
            hf.config.sliding_window = 5
        assert (full - ref)[real].abs().max() > 1e-3


def test_a_save_loads_back_in_transformers_as_the_same_class(pair, tmp_path):
    from transformers import AutoModelForCausalLM
    family, _, hf, lathe = pair
    with torch.no_grad():
        lathe.model.norm.weight.mul_(1.5)
    try:
        lathe.save_pretrained(tmp_path / "saved")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
        ids, mask, pos = ragged_batch(1)
        with torch.no_grad():
            ref = back(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            ours = lathe(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    finally:
        with torch.no_grad():
            lathe.model.norm.weight.div_(1.5)
    assert type(back).__name__ == ARCH[family] and getattr(back.config, "sliding_window", None) == getattr(hf.config, "sliding_window", None)
    assert_close_rel(ours[mask.bool()], ref[mask.bool()], name=f"{family} logits after a save")


@torch.no_grad()
def test_engine_greedy_equals_transformers_and_its_log_probs_the_forward(pair):
    family, path, hf, lathe = pair
    assert_engine_equals_transformers(hf, lathe, path, family)


def test_a_critic_round_trips_through_transformers_token_classification(pair, tmp_path):
    from transformers import AutoModelForTokenClassification
    family, path, _, _ = pair
    critic = load_lathe_value_model(path).eval()
    with torch.no_grad():
        critic.score.weight.normal_()
    save_pretrained(critic, tmp_path / "critic")
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCH[family].replace("ForCausalLM", "ForTokenClassification")
    ids, mask, pos = ragged_batch(2)
    with torch.no_grad():
        ours = critic(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert_close_rel(ours[mask.bool()], ref[mask.bool()], name=f"{family} values")


def test_dropout_in_the_config_runs_in_transformers_unless_override_config_zeroes_it(tmp_path):
    """Seed-OSS as released asks for dropout 0.1 (attention and residual), which transformers applies in a
    training-mode forward: lathe's decoder, which has none, refuses it and names the override that runs it there."""
    from lathe.models.hf import load_policy, select_impl
    path, hf = save_hf(tmp_path, "seed_oss")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(attention_dropout=0.1, residual_dropout=0.1)
    (path / "config.json").write_text(json.dumps(cfg))
    ok, why = supports(path)
    assert not ok and "override_config.attention_dropout=0.0" in why and "residual_dropout=0.1" in why
    assert type(select_impl(load_policy(str(path)))).__name__ == "SeedOssForCausalLM"   # transformers, dropout on
    zeroed = select_impl(load_policy(str(path), override_config={"attention_dropout": 0.0, "residual_dropout": 0.0}))
    assert isinstance(zeroed, LatheCausalLM)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert_close_rel(zeroed.eval()(ids).logits, hf(input_ids=ids, use_cache=False).logits, name="logits")


def test_a_tensor_parallel_engine_replica_generates_what_one_process_generates(tmp_path):
    """Over 2 gloo ranks (heads cut, the window and the biases per slice): greedy, sampled, and greedy after new
    weights, as one process."""
    from engine.test_tensor_parallel import assert_same_generations, build, generations, run_replica
    paths = [str(save_hf(tmp_path, family)[0]) for family in ("mistral_window", "seed_oss")]
    want = [generations(build(p, None), p) for p in paths]
    assert_same_generations(run_replica(2, paths), want, 2)
