"""The families' shared checks against transformers (test helper, not a test): logits of a ragged batch, padded
and packed; gradients of one loss over them; one ragged batch through both models with the load-balancing loss on, a
loss over logits and aux loss backpropagated on each side; a checkpoint saved by transformers, loaded and saved by
lathe, loaded by transformers; the engine's greedy tokens and log-probs; a critic from a causal LM's checkpoint and
back; a tensor-parallel engine replica."""

from __future__ import annotations

import json

import torch

from lathe.models.moe import collect_router_stats
from lathe.models.packing import pack_padded

from helpers import assert_close_rel

from .lathe_tiny import ragged_batch


def assert_logits_equal_transformers(hf, lathe, seed: int = 0, rel: float = 1e-5) -> None:
    """lathe's logits of a ragged batch (padded under both padded modes, and packed) equal transformers' (padded),
    within `rel` (norm-relative)."""
    ids, mask, pos = (t.to(lathe.device) for t in ragged_batch(seed))
    real = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        for mode in ("mask", "unpad"):
            lathe.padded_attention = mode
            assert_close_rel(lathe(ids, mask, pos).logits[real], ref[real], rel=rel, name=f"padded logits ({mode})")
        packed = pack_padded(ids, mask, pos)
        out = lathe.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                   return_hidden=False)
    assert_close_rel(out, ref[real], rel=rel, name="packed logits")


def assert_gradients_equal_transformers(hf, lathe, nonzero: tuple[str, ...], rel: float = 1e-6,
                                        layout=lambda grads: grads) -> None:
    """The gradients of every parameter after one loss over a ragged batch's logits (transformers padded, lathe packed)
    agree within `rel`; those named in `nonzero` are not all zero (they take part). `layout`: lathe's gradients by
    name in the checkpoint's layout (GLM-4's: `lathe.models.glm4.to_hub`)."""
    ids, mask, pos = ragged_batch(1)
    real = mask.bool()
    hf.zero_grad()
    hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[real].pow(2).mean().backward()
    packed = pack_padded(ids, mask, pos)
    lathe.zero_grad()
    lathe.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                         return_hidden=False).pow(2).mean().backward()
    grads = layout({n: p.grad for n, p in lathe.named_parameters()})
    ref = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(ref)
    for name in nonzero:
        assert grads[name].abs().sum() > 0, name
    assert_close_rel(grads, ref, rel=rel, name="gradients")


def assert_engine_equals_transformers(hf, lathe, path, name: str = "") -> None:
    """lathe's engine over checkpoint `path`: greedy tokens of three prompts those of transformers' `generate`, and
    their log-probs lathe's teacher-forced forward's."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    prompts = [[3, 17, 42, 9, 4, 77, 12, 5], [8, 1, 66, 23], [50, 2, 31, 99, 14, 7]]
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    for prompt, tokens, lps in zip(prompts, out.token_ids, out.logprobs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=10, min_new_tokens=10, eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist(), name
        with torch.no_grad():
            logits = lathe(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
        forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        assert_close_rel(torch.as_tensor(lps, dtype=torch.float64), forced, name=f"{name} log-probs")


def _loss(logits, aux):
    return logits.float().pow(2).mean() + 10.0 * aux


def aux_and_gradients(hf, lathe, seed: int = 1):
    """(lathe's RouterStats, its aux loss, transformers' aux loss, lathe's gradients by name, transformers' for the
    same names, the number of real tokens) after one backward of the same loss on each side (lathe packed,
    transformers padded)."""
    ids, mask, pos = ragged_batch(seed)
    real = mask.bool()
    hf.zero_grad()
    out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    _loss(out.logits[real], out.aux_loss).backward()
    packed = pack_padded(ids, mask, pos)
    lathe.zero_grad()
    with collect_router_stats(lathe) as stats:
        logits = lathe.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                      return_hidden=False)
    aux = stats.aux_loss()
    _loss(logits, aux).backward()
    grads = {n: p.grad for n, p in lathe.named_parameters()}
    ref = {n: p.grad for n, p in hf.named_parameters() if n in grads}
    return stats, aux, out.aux_loss, grads, ref, int(real.sum())


def round_trip(hf_dir, out_dir, vocab: int, **load_kwargs) -> tuple[set[str], str]:
    """Load transformers' save `hf_dir` into lathe, save it to `out_dir`, load that with transformers: logits equal at
    each step. Returns (the tensor names lathe wrote, the architecture its config.json names)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lathe.models import load_lathe_model
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, **load_kwargs).eval()
    lathe = load_lathe_model(hf_dir).eval()
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        assert_close_rel(lathe(ids).logits, ref, name="logits after loading transformers' save")
    lathe.save_pretrained(out_dir)
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    back = AutoModelForCausalLM.from_pretrained(out_dir, **load_kwargs).eval()
    with torch.no_grad():
        assert_close_rel(back(ids).logits, ref, name="transformers' logits after loading lathe's save")
    return names, json.loads((out_dir / "config.json").read_text())["architectures"][0]


def assert_critic_round_trip(hf, tmp_path, vocab: int, architecture: str, sparse=lambda layer: layer.mlp) -> None:
    """lathe's value model loads the causal LM `hf`'s saved backbone (its head at zero) and reads back the critic it
    saves (under `architecture`, for families transformers has no token-classification class of: lathe's name).
    `sparse`: layer 1's DeepSeek-style MoE block (Nemotron-H's: its mixer); None for a dense model."""
    from lathe.models.decoder import LatheValueModel
    from lathe.models.deepseek import DeepseekMoeBlock
    from lathe.models.value import load_value_model
    hf.save_pretrained(tmp_path / "policy")
    critic = load_value_model(str(tmp_path / "policy"))
    assert isinstance(critic, LatheValueModel)
    assert sparse is None or isinstance(sparse(critic.model.layers[1]), DeepseekMoeBlock)
    ids = torch.randint(1, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert critic(ids).logits.abs().max() == 0
        critic.score.weight.normal_()
        want = critic(ids).logits
    critic.save_pretrained(tmp_path / "critic")
    back = load_value_model(str(tmp_path / "critic"))
    assert isinstance(back, LatheValueModel) and back.config.architecture == architecture
    with torch.no_grad():
        assert_close_rel(back(ids).logits, want, rel=1e-6, name="values after the round trip")


def assert_tp_replica_equals_one_process(hf, tmp_path) -> None:
    """A TP=2 engine replica over 2 gloo ranks of `hf`'s saved checkpoint: greedy, sampled, and greedy after new
    weights, as one process."""
    from engine.test_tensor_parallel import assert_same_generations, build, generations, run_replica
    hf.save_pretrained(tmp_path)
    path = str(tmp_path)
    want = [generations(build(path, None), path)]
    assert_same_generations(run_replica(2, [path]), want, 2)


def assert_round_trip_without_the_mtp_layer(hf, tmp_path, vocab: int, architecture: str, shared: str, bias: str,
                                            names: set[str]) -> None:
    """transformers' save of `hf` (3 layers, layer 1 sparse) plus an MTP layer at model.layers.3 (as DeepSeek-style
    checkpoints hold one: its `shared` experts' name among its tensors) loads into lathe with the selection bias
    (`model.layers.1.<bias>` on disk) in float32; lathe's save holds the same tensors under the same names (`names`
    among them) but the MTP layer's, and transformers loads it to the same logits."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from lathe.models import load_lathe_model
    hf.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(str(file))
    with_mtp = {**state, "model.layers.3.eh_proj.weight": torch.zeros(32, 64),
                f"model.layers.3.mlp.{shared}.up_proj.weight": torch.zeros(16, 32)}
    save_file(with_mtp, str(file), metadata={"format": "pt"})
    saved, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", vocab, experts_implementation="eager")
    assert saved == set(state) and arch == architecture and names <= saved
    loaded = load_lathe_model(tmp_path / "hf", torch.bfloat16).model.layers[1].mlp.gate.e_score_correction_bias
    assert loaded.dtype == torch.float32 and torch.equal(loaded, state[f"model.layers.1.{bias}"])
    with safe_open(str(tmp_path / "lathe" / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("model.layers.3.") for k in f.keys())
