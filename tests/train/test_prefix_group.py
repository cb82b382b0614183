"""Prefix-grouped forward (actor.use_prefix_grouper): the same log-probs, entropies and gradients as the padded
forward of every row alone, with each prompt computed once."""

import numpy as np
import pytest
import torch

from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train.logprob import batched_token_stats, response_log_probs
from lathe.train.micro import micro_batches
from lathe.train.prefix_group import grouped_layout

from helpers import assert_close_rel

from .conftest import PAD, VOCAB


def _grouped_batch(n=3, seed=0, shuffle=True):
    """3 prompts x n ragged responses, rows shuffled (a shuffled mini-batch keeps no group together)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in (3, 5, 2)]
    responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(len(prompts) * n)]
    batch = to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * len(responses)),
                     PAD, n=n)
    if shuffle:
        batch = batch.select(torch.randperm(len(batch), generator=g).tolist())
    return batch


def test_layout_runs_each_prompt_once():
    """One packed stream: each prompt once, then every response, prompt by prompt; a response's segment attends to
    its prompt's rows, then its own, and a prompt's to itself; each response token is predicted from the token
    before it in its own segment, the first from its prompt's last token."""
    batch = _grouped_batch()
    layout = grouped_layout(batch)
    responses = int(batch["response_mask"].sum())
    assert layout.input_ids.shape == ((3 + 5 + 2) + responses,)             # three prompts once, every response
    assert layout.source.numel() == responses and len(layout.cu_q) == 3 + 9 + 1
    cu_q, cu_k, kv = layout.cu_q.tolist(), layout.cu_k.tolist(), layout.kv_index.tolist()
    segments = [(list(range(cu_q[s], cu_q[s + 1])), kv[cu_k[s]:cu_k[s + 1]]) for s in range(len(cu_q) - 1)]
    prompts = [rows for rows, keys in segments[:3]]
    assert all(keys == rows for rows, keys in segments[:3])             # the prompts' segments lead
    owners = []
    for rows, keys in segments[3:]:
        owners.append(prompts.index(keys[:-len(rows)]))                 # its prompt, then itself
        assert keys[-len(rows):] == rows
    assert owners == sorted(owners) and len(set(owners)) == 3
    assert layout.max_q == max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    assert layout.max_k == max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))


def test_layout_is_worked_out_from_the_host_copies(monkeypatch):
    """With the pass's host copies of the mask and prompts (`with_host_mask(prompts=True)`, taken once for the whole
    batch), a micro-batch's layout reads nothing back from the device (each read would be a host sync that drains the
    queue between micro-batches) and equals the one worked out from the device's tensors."""
    batch = _grouped_batch()
    expected = grouped_layout(batch)
    hosted = micro_batches(batch, size=len(batch), grouped=True)[0][0]

    def no_reads(*args, **kwargs):
        raise AssertionError("the layout read a tensor back from the device")
    monkeypatch.setattr(torch.Tensor, "cpu", no_reads)
    layout = grouped_layout(hosted)
    monkeypatch.undo()
    for name in ("input_ids", "position_ids", "cu_q", "cu_k", "kv_index", "source", "flat"):
        assert torch.equal(getattr(layout, name), getattr(expected, name)), name
    assert (layout.max_q, layout.max_k) == (expected.max_q, expected.max_k)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grouped_equals_padded_in_value_and_gradient(make_lathe, temperature):
    batch = _grouped_batch()
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    out, grads = {}, {}
    for grouped in (False, True):
        model = make_lathe()
        logp, ent = response_log_probs(model, batch, temperature=temperature, calculate_entropy=True,
                                       prefix_grouper=grouped, chunk_size=4)
        ((logp + 0.1 * ent) * weights * batch["response_mask"]).sum().backward()
        out[grouped] = (logp.detach(), ent.detach())
        grads[grouped] = {k: p.grad.clone() for k, p in model.named_parameters()}
    mask = batch["response_mask"].bool()
    assert_close_rel(out[True][0][mask], out[False][0][mask], name="log-probs")
    assert_close_rel(out[True][1][mask], out[False][1][mask], name="entropy")
    assert torch.all(out[True][0][~mask] == 0)
    assert_close_rel(grads[True], grads[False], name="gradients")


def _gpt_oss():
    """A tiny GPT-OSS in lathe's decoder (a 4-token sliding window, then a full layer; sinks; 4 experts top-2)."""
    from lathe.models.hf import lathe_from_transformers
    from models.gpt_oss_tiny import gpt_oss_model
    return lathe_from_transformers(gpt_oss_model(vocab_size=VOCAB))


def _grouped_against_per_row(model_of, batch, **kwargs):
    """{grouped: (log-probs, their gradients)} of the packed per-row and the prefix-grouped forward."""
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    out = {}
    for grouped in (False, True):
        model = model_of()
        logp, _ = response_log_probs(model, batch, prefix_grouper=grouped, remove_padding=True, **kwargs)
        (logp * weights * batch["response_mask"]).sum().backward()
        out[grouped] = (logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("flash", [False, True])
def test_grouped_gpt_oss_windows_and_sinks_equal_the_per_row_forward(monkeypatch, flash):
    """GPT-OSS's sliding window (here 4 tokens, shorter than prompt + response) and sinks in the grouped forward:
    each response's window reaches back into its prompt's gathered keys. The explicit softmax per segment, and the
    flash path (the flash ops' contract in plain torch standing in for them, `tests/models/test_sink_flash.py`), give
    the per-row forward's log-probs and gradients."""
    from lathe.models import attention, sink_flash
    from models.test_sink_flash import reference_core, reference_core_backward
    if flash:                   # the "varlen" backend on the CPU: the reference core in place of the flash ops
        calls = []
        monkeypatch.setattr(sink_flash, "flash_core", lambda *a: calls.append(a[3] is not a[4]) or reference_core(*a))
        monkeypatch.setattr(sink_flash, "flash_core_backward", reference_core_backward)
        checked = []            # the layouts whose one-time check was asked for (its last argument: at_end)
        monkeypatch.setattr(sink_flash, "flash_sinks_agree", lambda *a: checked.append(a[-1]) or True)
        monkeypatch.setattr(attention, "varlen_aligns_causal_at_end", lambda *a: True)
        monkeypatch.setattr(attention, "varlen_takes_gqa", lambda *a: True)
        monkeypatch.setattr(attention, "causal_varlen", lambda q, k, v, cu_q, cu_k, mq, mk: attention.segment_attention(
            q, k, v, cu_q.tolist(), cu_k.tolist(), None, None))

        def model_of():
            model = _gpt_oss()
            monkeypatch.setattr(model, "packed_backend", lambda: "varlen")
            return model
    else:
        model_of = _gpt_oss
    out = _grouped_against_per_row(model_of, _grouped_batch(n=3))
    mask = _grouped_batch(n=3)["response_mask"].bool()
    assert_close_rel(out[True][0][mask], out[False][0][mask], name="log-probs")
    assert_close_rel(out[True][1], out[False][1], name="gradients")
    if flash:
        assert any(calls) and not all(calls)       # grouped segments (fewer queries than keys) and packed sequences
        assert set(checked) == {True, False}       # each asked for the check of its own alignment


def _hybrid(family):
    """A tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next in lathe's decoder (a gated-DeltaNet layer with a 4-tap convolution,
    then gated full attention)."""
    from transformers import AutoModelForCausalLM

    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hybrid_config
    if family == "nemotron_h":      # Mamba2, MoE, attention, MLP, Mamba2, MoE layers
        from models.nemotron_tiny import nemotron_model
        return lathe_from_transformers(nemotron_model(vocab_size=VOCAB))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return lathe_from_transformers(AutoModelForCausalLM.from_config(hybrid_config(family, vocab_size=VOCAB)))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("chunk", [32, 2])
def test_grouped_linear_attention_equals_the_per_row_forward(monkeypatch, family, chunk):
    """Qwen3.5's linear-attention layers (Nemotron-H's Mamba2 ones) in the grouped stream: each prompt runs once from
    a zero state and each response continues from its prompt's final recurrent (scan) state, its convolution behind
    the prompt's last K-1 inputs (a 2-token prompt here is shorter than that). The per-row forward's log-probs and
    gradients, gradients flowing back into the prompt through the shared state; `chunk` 2 runs the delta rule's (the
    scan's) chunked form over many chunks."""
    import functools

    from lathe.models import linear_attention, nemotron_h, ssd
    monkeypatch.setattr(linear_attention, "CPU_CHUNK", chunk)
    monkeypatch.setattr(nemotron_h, "chunk_scan", functools.partial(ssd.chunk_scan, chunk_size=chunk))
    batch = _grouped_batch(n=3)
    out = _grouped_against_per_row(lambda: _hybrid(family), batch)
    mask = batch["response_mask"].bool()
    assert_close_rel(out[True][0][mask], out[False][0][mask], name="log-probs")
    assert out[True][1].keys() == out[False][1].keys()
    assert_close_rel(out[True][1], out[False][1], name="gradients")


def test_grouped_linear_attention_without_response_tokens():
    """A micro-batch whose rows all have empty responses: the linear layers run the prompts alone; no log-prob."""
    batch = to_batch([[3, 4, 5], [6, 7]], RolloutOutput([[]] * 4, [[]] * 4, ["stop"] * 4), PAD, n=2)
    for grouped in (True, False):
        logp, _ = response_log_probs(_hybrid("qwen3_5_text"), batch, prefix_grouper=grouped, remove_padding=True)
        assert logp.shape == batch["responses"].shape and not logp.any()


def test_linear_layout_continues_each_response_from_its_prompt():
    """The prompts lead the stream (packed from a zero state), the responses follow; each response is convolved
    behind its prompt's last min(K-1, prompt) tokens (one convolution after the prompts), those copies dropped from
    its outputs."""
    batch = _grouped_batch(n=2, shuffle=False)
    layout = grouped_layout(batch, conv_kernel=4)
    lin, cu = layout.linear, layout.cu_q.tolist()
    segments = [list(range(a, b)) for a, b in zip(cu[:-1], cu[1:])]
    prompts, responses = segments[:3], segments[3:]                     # 3 prompts, then 2 responses each
    assert lin.prompt_tokens == len(sum(prompts, [])) and lin.cu_prompt.tolist() == [0, 3, 8, 10]
    assert sum(responses, []) == list(range(lin.prompt_tokens, layout.input_ids.numel()))
    assert lin.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert lin.cu_response.tolist() == [0] + np.cumsum([len(r) for r in responses]).tolist()
    ext, cu_conv = lin.extended.tolist(), lin.cu_conv.tolist()
    assert cu_conv[:4] == lin.cu_prompt.tolist()                        # the prompts, then each response extended
    conv = list(range(lin.prompt_tokens)) + ext
    for r, (rows, prompt) in enumerate(zip(responses, [p for p in prompts for _ in range(2)])):
        assert conv[cu_conv[3 + r]:cu_conv[4 + r]] == prompt[-3:] + rows
    assert [ext[i] for i in lin.kept.tolist()] == sum(responses, [])
    ids, rows = layout.input_ids.tolist(), batch["input_ids"].tolist()
    P = batch["prompts"].shape[1]
    for g, prompt in enumerate(prompts):                                # rows 2g, 2g+1 share prompt g
        assert [ids[i] for i in prompt] == [t for t, m in zip(rows[2 * g][:P], batch["attention_mask"][2 * g]) if m]
    assert grouped_layout(batch).linear is None


def test_batched_grouped_with_sum_pi_squared(make_lathe):
    batch = _grouped_batch(seed=3)
    model = make_lathe().eval()
    plain = batched_token_stats(model, batch, micro_batch_size=4, calculate_sum_pi_squared=True)
    grouped = batched_token_stats(model, batch, micro_batch_size=4, calculate_sum_pi_squared=True,
                                  prefix_grouper=True)            # micro-batches cut groups: each part groups alone
    mask = batch["response_mask"].bool()
    for name, a, b in zip(("log-probs", "sum p^2"), (grouped[0], grouped[2]), (plain[0], plain[2])):
        assert_close_rel(a[mask], b[mask], name=name)


def test_grouping_needs_lathes_decoder(make_model):
    with pytest.raises(ValueError, match="use_prefix_grouper=true needs lathe's text decoder"):
        response_log_probs(make_model(), _grouped_batch(), prefix_grouper=True)


@pytest.mark.gpu
def test_grouped_on_flash_attention_equals_packed_on_cuda(make_lathe):
    """bf16 on CUDA: the grouped stream in one flash varlen call (each response's keys its prompt's, gathered, then its
    own; the causal mask aligned at each segment's end, as the probe found on this device) gives the packed
    per-row forward's log-probs and gradients, norm-relative."""
    from lathe.models.attention import varlen_aligns_causal_at_end
    assert varlen_aligns_causal_at_end(0, torch.bfloat16)
    batch = _grouped_batch(n=4).to("cuda")
    out, grads = {}, {}
    for grouped in (False, True):
        model = make_lathe().to("cuda", torch.bfloat16)
        assert model.packed_backend() == "varlen"
        logp, _ = response_log_probs(model, batch, temperature=1.0, prefix_grouper=grouped, remove_padding=True)
        (logp * batch["response_mask"]).sum().backward()
        out[grouped] = logp.detach().float()
        grads[grouped] = {k: p.grad.float() for k, p in model.named_parameters()}
    mask = batch["response_mask"].bool()
    assert_close_rel(out[True][mask], out[False][mask], rel=2e-2, name="log-probs")
    hosted = micro_batches(batch, size=len(batch), grouped=True)[0][0]
    torch.cuda.set_sync_debug_mode("error")         # building a micro-batch's layout waits for no device work
    try:
        grouped_layout(hosted)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_rel(grads[True], grads[False], rel=5e-2, name="gradients")


@pytest.mark.gpu
def test_grouped_linear_attention_on_cuda_equals_packed():
    """bf16 on CUDA, key and value heads of 128 as Qwen3.5's: fla's chunked delta rule from its prompt's final state
    (forward and backward through the initial and final states) and its packed convolution give the packed per-row
    forward's log-probs and gradients, norm-relative; and with no gradient (the reference pass) the same log-probs."""
    from transformers import AutoModelForCausalLM

    from lathe.models.hf import lathe_from_transformers
    from lathe.models.linear_attention import fla_ops
    from models.lathe_tiny import hybrid_config
    if fla_ops() is None:
        pytest.skip("flash-linear-attention is not installed")
    batch = _grouped_batch(n=4).to("cuda")
    cfg = hybrid_config("qwen3_5_text", vocab_size=VOCAB, linear_key_head_dim=128, linear_value_head_dim=128)
    out, grads, frozen = {}, {}, {}
    for grouped in (False, True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = lathe_from_transformers(AutoModelForCausalLM.from_config(cfg)).to("cuda", torch.bfloat16)
        logp, _ = response_log_probs(model, batch, temperature=1.0, prefix_grouper=grouped, remove_padding=True)
        (logp * batch["response_mask"]).sum().backward()
        out[grouped] = logp.detach().float()
        grads[grouped] = {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            frozen[grouped] = response_log_probs(model, batch, temperature=1.0, prefix_grouper=grouped,
                                                 remove_padding=True)[0].float()
    mask = batch["response_mask"].bool()
    assert_close_rel(out[True][mask], out[False][mask], rel=2e-2, name="log-probs")
    assert_close_rel(frozen[True][mask], frozen[False][mask], rel=2e-2, name="log-probs without gradients")
    assert grads[True].keys() == grads[False].keys()
    assert_close_rel(grads[True], grads[False], rel=5e-2, name="gradients")


@pytest.mark.gpu
def test_grouped_linear_layers_derive_their_bounds_once_for_all_layers(monkeypatch):
    """A grouped micro-batch hands fla three bounds tensors in turn (the convolution's over the prompts and then each
    response behind its prompt's last inputs, the prompts', the responses'): fla expands them (`_segmented_arange`,
    a host sync) no more often for six linear layers than for two, forward and backward (`fla_cu_seqlens` keeps each
    one's int64 form)."""
    pytest.importorskip("fla")
    import fla.ops.utils.index as index
    from transformers import AutoModelForCausalLM

    from lathe.models.hf import lathe_from_transformers
    from models.lathe_tiny import hybrid_config
    expand, calls = index._segmented_arange, []
    monkeypatch.setattr(index, "_segmented_arange", lambda counts: calls.append(1) or expand(counts))
    batch = _grouped_batch(n=4).to("cuda")

    def layers(n: int) -> int:
        cfg = hybrid_config("qwen3_5_text", vocab_size=VOCAB, linear_key_head_dim=128, linear_value_head_dim=128,
                            num_hidden_layers=n, layer_types=["linear_attention"] * n)
        model = lathe_from_transformers(AutoModelForCausalLM.from_config(cfg)).to("cuda", torch.bfloat16)
        calls.clear()
        logp, _ = response_log_probs(model, batch, temperature=1.0, prefix_grouper=True, remove_padding=True)
        (logp * batch["response_mask"]).sum().backward()
        torch.cuda.synchronize()
        return len(calls)

    layers(1)                                # (fla's layout check, once)
    assert layers(6) == layers(2)
