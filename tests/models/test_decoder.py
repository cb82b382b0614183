"""lathe's decoder against transformers: same logits on ragged batches, packed == padded, checkpointing, bf16."""

import pytest
import torch

from lathe.models import load_lathe_model
from lathe.models.decoder import LatheCausalLM, init_weights
from lathe.models.packing import pack_padded, pack_sequences, unpack_to_padded

from helpers import assert_close_rel

from .lathe_tiny import FAMILIES, VOCAB, ragged_batch, save_hf


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in (False, True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def pair(request, tmp_path_factory):
    family, tie = request.param
    path, hf = save_hf(tmp_path_factory.mktemp("ckpt"), family, tie=tie)
    return hf, load_lathe_model(path).eval()


@pytest.mark.parametrize("mode", ["mask", "unpad"])
def test_padded_logits_equal_transformers_on_ragged_batches(pair, mode):
    hf, lathe = pair
    lathe.padded_attention = mode
    for seed in range(2):
        ids, mask, pos = ragged_batch(seed)
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            out = lathe(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        real = mask.bool()
        assert out.shape == ref.shape
        assert_close_rel(out[real], ref[real], name=f"logits of batch {seed}")
        assert torch.isfinite(out).all(), "padding positions must not produce NaN (it would leak into gradients)"


def test_unpadded_batch_without_mask_equals_transformers(pair):
    hf, lathe = pair
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert_close_rel(lathe(ids).logits, hf(input_ids=ids, use_cache=False).logits, name="logits")


def test_packed_forward_equals_padded_forward(pair):
    _, lathe = pair
    ids, mask, pos = ragged_batch(3)
    packed = pack_padded(ids, mask, pos)
    with torch.no_grad():
        padded = lathe(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        flat = lathe.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                    return_hidden=False)
    assert flat.shape == (int(mask.sum()), VOCAB)
    assert_close_rel(unpack_to_padded(flat, packed)[mask.bool()], padded[mask.bool()], name="packed logits")


def test_packed_sequences_do_not_attend_across_boundaries(pair):
    _, lathe = pair
    a, b = torch.randint(0, VOCAB, (7,)), torch.randint(0, VOCAB, (5,))
    with torch.no_grad():
        alone = lathe.forward_packed(*pack_sequences([b]))
        ids, pos, cu, mx = pack_sequences([a, b])
        together = lathe.forward_packed(ids, pos, cu, mx)
        # the same tokens as ONE sequence: b would then see a, and its hidden states must change
        merged = lathe.forward_packed(*pack_sequences([torch.cat([a, b])]))
    assert_close_rel(together[7:], alone, name="hidden states of the second sequence")
    assert (merged[7:] - alone).abs().max() > 1e-3


def test_packed_and_padded_give_the_same_loss_and_gradients(tmp_path):
    path, _ = save_hf(tmp_path, "qwen2")
    ids, mask, pos = ragged_batch(5)
    grads = []
    for packed_path in (False, True):
        model = load_lathe_model(path)
        if packed_path:
            p = pack_padded(ids, mask, pos)
            logits = unpack_to_padded(model.forward_packed(p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen,
                                                           return_hidden=False), p)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        loss = (logits.log_softmax(-1)[..., 0] * mask).sum() / mask.sum()
        loss.backward()
        grads.append((loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert_close_rel(l1, l0, name="loss")
    assert_close_rel(g1, g0, name="gradients")


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    path, _ = save_hf(tmp_path, "qwen3")
    ids, mask, pos = ragged_batch(1)
    grads = []
    for ckpt in (False, True):
        model = load_lathe_model(path).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()].pow(2).mean().backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert_close_rel(grads[1], grads[0], name="checkpointed gradients")


def test_checkpointing_recomputes_each_layer_in_backward(tmp_path, monkeypatch):
    from lathe.models import decoder
    path, _ = save_hf(tmp_path, "llama")
    ids = torch.randint(0, VOCAB, (2, 6))
    calls = []
    mlp_forward = decoder.MLP.forward
    monkeypatch.setattr(decoder.MLP, "forward", lambda self, x: calls.append(1) or mlp_forward(self, x))
    for ckpt, per_layer in ((False, 1), (True, 2)):
        model = load_lathe_model(path).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        calls.clear()
        model(ids).logits.sum().backward()
        assert len(calls) == per_layer * model.config.num_hidden_layers


def test_bf16_weights_run_and_track_fp32(tmp_path):
    path, _ = save_hf(tmp_path, "qwen2")
    ids, mask, pos = ragged_batch(2)
    fp32 = load_lathe_model(path)
    bf16 = load_lathe_model(path, torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        a = fp32(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        b = bf16(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert b.dtype == torch.bfloat16
    real = mask.bool()
    assert_close_rel(b[real], a[real], rel=0.05, name="bf16 logits")   # 8-bit mantissas: 1e-2 here
    # rope frequencies stay float32 after .to(bfloat16)
    assert bf16.to(torch.bfloat16).model.rotary_emb.inv_freq.dtype == torch.float32


def test_return_hidden_skips_the_lm_head(pair):
    _, lathe = pair
    ids, mask, pos = ragged_batch(0)
    with torch.no_grad():
        out = lathe(input_ids=ids, attention_mask=mask, position_ids=pos, return_hidden=True)
        full = lathe(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert out.logits is None and out.hidden_states.shape == (*ids.shape, lathe.config.hidden_size)
    assert_close_rel(lathe.lm_head(out.hidden_states), full, name="logits")


def test_tied_model_shares_one_tensor_and_untied_does_not(pair):
    _, lathe = pair
    shared = lathe.lm_head.weight is lathe.model.embed_tokens.weight
    assert shared == lathe.config.tie_word_embeddings


def test_parameter_names_are_the_checkpoint_names(pair):
    hf, lathe = pair
    assert set(lathe.state_dict()) == set(hf.state_dict())


def test_model_built_from_config_initialises_and_runs():
    from lathe.models.config import LatheConfig

    from .lathe_tiny import hf_config
    cfg = LatheConfig.from_hf_dict({**hf_config("qwen3").to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    model = LatheCausalLM(cfg)
    init_weights(model)
    assert model.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    assert torch.isfinite(model(torch.randint(0, VOCAB, (1, 5))).logits).all()
