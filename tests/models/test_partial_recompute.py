"""Partial activation recomputation (`gradient_checkpointing_enable(layers=N)`, `lathe.models.decoder.recomputes`):
the first N decoder layers recompute in backward, the rest keep their activations, and the loss and gradients are
those of a run without checkpointing, on the text decoder, the VL model's language model and MiMo's MTP layers."""

from __future__ import annotations

import pytest
import torch

from lathe.models.attention import PackedAttention
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights
from lathe.models.mtp import mtp_stream

from helpers import assert_close_rel

LAYERS = 4
BASE = {"vocab_size": 61, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny(architecture: str = "Qwen3ForCausalLM", **extra) -> LatheCausalLM:
    torch.manual_seed(0)
    model = LatheCausalLM(LatheConfig.from_hf_dict({**BASE, "architectures": [architecture], **extra}))
    init_weights(model, std=0.2)
    return model.double().train()


def packed_stream(seed: int = 0):
    """(input_ids, position_ids, cu_seqlens, max_seqlen) of three sequences laid end to end."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 7, 4]
    ids = torch.randint(0, BASE["vocab_size"], (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    return ids, pos, cu, max(lengths)


def count_calls(layers) -> list[int]:
    """Per-layer forward-call counters (a pre-hook each; a recomputation calls the layer again)."""
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def recomputed_in_backward(model, layers, loss_fn) -> tuple[torch.Tensor, dict, list[int]]:
    """(loss, gradients, the indices of `layers` called again during backward)."""
    calls = count_calls(layers)
    loss = loss_fn(model)
    after_forward = list(calls)
    loss.backward()
    return loss.detach(), grads(model), [i for i, (a, b) in enumerate(zip(after_forward, calls)) if b > a]


def text_loss(model):
    ids, pos, cu, max_len = packed_stream()
    hidden = model.hidden_packed(ids, pos, cu, max_len)
    return (model.lm_head(hidden).log_softmax(-1)[:-1].gather(-1, ids[1:, None])).mean()


@pytest.mark.parametrize("layers", [0, 1, 2, LAYERS, None, LAYERS + 3])
def test_the_first_n_layers_recompute_and_gradients_equal_no_checkpointing(layers):
    ref = tiny()
    want_loss, want, again = recomputed_in_backward(ref, ref.model.layers, text_loss)
    assert again == [] and len(want) == len(list(ref.parameters()))
    model = tiny()
    model.gradient_checkpointing_enable(layers=layers)
    loss, got, again = recomputed_in_backward(model, model.model.layers, text_loss)
    first = LAYERS if layers is None else min(layers, LAYERS)
    assert again == list(range(first)), f"layers={layers}: recomputed {again}"
    assert_close_rel(loss, want_loss, rel=1e-12, name="loss")
    assert_close_rel(got, want, rel=1e-12, name=f"gradients with the first {layers} layers recomputed")


def test_the_switch_acts_in_training_only_and_disable_clears_the_count():
    model = tiny()
    model.gradient_checkpointing_enable(layers=2)
    model.eval()
    _, _, again = recomputed_in_backward(model, model.model.layers, text_loss)
    assert again == [], "an eval-mode forward never checkpoints"
    model.train().gradient_checkpointing_disable()
    assert model.model.gradient_checkpointing_layers is None and not model.model.gradient_checkpointing
    model.gradient_checkpointing_enable()                          # transformers' call: every layer
    model.zero_grad()
    assert recomputed_in_backward(model, model.model.layers, text_loss)[2] == list(range(LAYERS))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="layers"):
            model.gradient_checkpointing_enable(layers=bad)


def test_mtp_layers_count_after_the_main_stack():
    """MiMo's MTP layers are layers LAYERS, LAYERS + 1 of the count: a count within the main stack leaves them
    their activations (Megatron's block method skips MTP recompute too), a count past it reaches them."""
    def loss_fn(model):
        ids, pos, cu, max_len = packed_stream(1)
        hidden = model.hidden_packed(ids, pos, cu, max_len)
        attn = PackedAttention(cu, max_len, model.packed_backend())
        outs = mtp_stream(model, hidden, ids, pos, cu, attn)
        return sum(model.lm_head(h).logsumexp(-1).mean() for h in [hidden, *outs])

    mimo = dict(architecture="MiMoForCausalLM", model_type="mimo", num_nextn_predict_layers=2)
    ref = tiny(**mimo)
    assert len(ref.model.mtp_layers) == 2
    stack = lambda m: [*m.model.layers, *m.model.mtp_layers]        # noqa: E731
    want_loss, want, _ = recomputed_in_backward(ref, stack(ref), loss_fn)
    for layers, again in ((2, [0, 1]), (LAYERS, [0, 1, 2, 3]), (LAYERS + 1, [0, 1, 2, 3, 4]),
                          (None, [0, 1, 2, 3, 4, 5])):
        model = tiny(**mimo)
        model.gradient_checkpointing_enable(layers=layers)
        loss, got, recomputed = recomputed_in_backward(model, stack(model), loss_fn)
        assert recomputed == again, f"layers={layers}: recomputed {recomputed}"
        assert_close_rel(loss, want_loss, rel=1e-12, name="loss")
        assert_close_rel(got, want, rel=1e-12, name=f"MTP gradients, layers={layers}")


def test_vl_language_model_recomputes_its_first_n_layers():
    pytest.importorskip("transformers")
    from lathe.models.vl.config import VLConfig
    from lathe.models.vl.model import LatheVLForConditionalGeneration
    from models.vl_tiny import hf_config

    def build():
        torch.manual_seed(0)
        model = LatheVLForConditionalGeneration(VLConfig.from_hf_dict(hf_config("qwen3_vl").to_dict()))
        init_weights(model, std=0.2)
        return model.double().train()

    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    loss_fn = lambda m: m(input_ids=ids).logits.logsumexp(-1).mean()      # noqa: E731
    ref = build()
    want_loss, want, _ = recomputed_in_backward(ref, ref.model.language_model.layers, loss_fn)
    model = build()
    model.gradient_checkpointing_enable(layers=1)
    loss, got, again = recomputed_in_backward(model, model.model.language_model.layers, loss_fn)
    assert again == [0] and len(model.model.language_model.layers) == 2
    assert_close_rel(loss, want_loss, rel=1e-12, name="loss")
    assert_close_rel(got, want, rel=1e-12, name="VL gradients")
