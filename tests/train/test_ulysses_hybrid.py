"""lathe.train.ulysses with the hybrid families (Qwen3.5, Qwen3-Next: gated-DeltaNet linear attention beside gated
full attention) and GPT-OSS (a sink per query head, sliding-window layers): a packed forward over 2 ranks (gloo,
float64) gives the one-process logits, loss and parameter gradients (the group's gradients summed, as FSDP2's
reduce-scatter sums them); the checks on the heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import assert_close_rel, gloo_rank, spawn_saving_ranks

from lathe.models.attention import PackedAttention
from lathe.models.hf import lathe_from_transformers
from lathe.train.ulysses import check_model, local_slice, padded_length

from models.lathe_tiny import VOCAB, hf_model

S, JOIN_S = 2, 120
# split projections; fused ones with MoE layers; sinks; Mamba2 (split by groups), attention without RoPE, MoE
FAMILIES = ("qwen3_5_text", "qwen3_next", "gpt_oss", "nemotron_h")
LENGTHS = [5, 1, 9, 4]                         # 19 tokens: padded to 20 over 2 ranks
KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def inputs():
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    ids = torch.randint(1, VOCAB, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu, torch.randn(T, VOCAB, generator=g, dtype=torch.float64)


def run(model, logits_of) -> dict:
    """Logits (T, V), loss sum(logits * w) and the parameter gradients."""
    model.zero_grad()
    *_, w = inputs()
    logits = logits_of(model)
    loss = (logits * w).sum()
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def one_process(model) -> dict:
    ids, pos, cu, _ = inputs()
    return run(model, lambda m: m.lm_head(m.hidden_with(ids, pos, PackedAttention(cu, max(LENGTHS)))))


def rank_forward(model, sp) -> dict:
    """This rank's slice through the decoder under `UlyssesAttention`, the group's logits gathered."""
    from lathe.train.ulysses import UlyssesAttention, gather_tokens
    ids, pos, cu, _ = inputs()
    T = len(ids)
    bounds = torch.cat([cu, torch.tensor([padded_length(T, sp.size)], dtype=torch.int32)])
    attn = UlyssesAttention(PackedAttention(bounds, max(LENGTHS)), sp)
    res = run(model, lambda m: gather_tokens(m.lm_head(m.hidden_with(local_slice(ids, sp), local_slice(pos, sp),
                                                                     attn)), sp)[:T])
    for g in res["grads"].values():
        dist.all_reduce(g, group=sp.group)
    return res


def rank_main(rank: int, port: int, root: str, queue) -> None:
    def work():
        from lathe.train.ulysses import sequence_parallel
        sp, res = sequence_parallel(S), {}
        for family, model in torch.load(Path(root) / "models.pt", weights_only=False).items():
            check_model(model, S, KEY)
            res[family] = rank_forward(model, sp)
        torch.save(res, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, S, port, queue, work, JOIN_S)


def family_runs(root: Path, families, one_process, rank_main, world: int, preload: list[str]):
    """(one-process results, each rank's) by family: each family's tiny float64 model saved in `root`/models.pt, run
    by `one_process` here and by `rank_main` (a `gloo_rank` body that saves its results) on `world` ranks."""
    from models.gpt_oss_tiny import gpt_oss_model
    from models.nemotron_tiny import nemotron_model
    special = {"gpt_oss": gpt_oss_model, "nemotron_h": nemotron_model}
    models = {f: lathe_from_transformers(special[f](seed=3) if f in special else hf_model(f, seed=3))
              .double().train() for f in families}
    torch.save(models, root / "models.pt")
    want = {f: one_process(m) for f, m in models.items()}
    return want, spawn_saving_ranks(rank_main, world, root, preload, JOIN_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return family_runs(tmp_path_factory.mktemp("ulysses_hybrid"), FAMILIES, one_process, rank_main, S,
                       [__name__, "lathe.models.qwen3_5", "lathe.train.ulysses"])


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one_process(runs, family):
    want, ranks = runs
    want = want[family]
    for rank in ranks:
        got = rank[family]
        assert_close_rel(got["logits"], want["logits"], 1e-10, name=f"{family} logits")
        assert_close_rel(got["loss"], want["loss"], 1e-10, name=f"{family} loss")
        # (the decay gate is computed in float32 on both sides; summing the group's parts reorders its rounding)
        assert_close_rel(got["grads"], want["grads"], 1e-7, name=f"{family} gradients")
    if family == "gpt_oss":          # (each rank computes its heads' sinks: the group's sum is every sink's gradient)
        for layer in (0, 1):
            assert want["grads"][f"model.layers.{layer}.self_attn.sinks"].abs().min() > 0
        return
    if family == "nemotron_h":       # (each rank its groups' heads: every head's and channel's gradient is reached)
        for name in ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight", "in_proj.weight"):
            assert want["grads"][f"model.layers.0.mixer.{name}"].abs().min() > 0, name
        return
    for name in ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "in_proj_qkv.weight" if family == "qwen3_5_text"
                 else "in_proj_qkvz.weight"):
        assert want["grads"][f"model.layers.0.linear_attn.{name}"].abs().sum() > 0


def test_linear_key_heads_must_split_over_the_group():
    """The tiny hybrids: 4 query / 2 key-value heads (size 4 passes there), 2 linear key heads / 4 value heads."""
    model = lathe_from_transformers(hf_model("qwen3_5_text"))
    check_model(model, 2, KEY)
    with pytest.raises(ValueError, match=rf"{KEY}=4: Qwen3_5ForCausalLM's linear-attention layers have 2 key heads "
                                         rf"\(4 value heads\).* Fix: set {KEY} to 1 or 2"):
        check_model(model, 4, KEY)


def test_mamba2_groups_must_split_over_the_group():
    """The tiny Nemotron-H: 2 groups of 2 Mamba2 heads (and 4 query / 2 key-value heads)."""
    from models.nemotron_tiny import nemotron_model
    model = lathe_from_transformers(nemotron_model())
    check_model(model, 2, KEY)
    with pytest.raises(ValueError, match=rf"{KEY}=4: NemotronHForCausalLM's Mamba2 layers have 2 groups .* Fix: set "
                                         rf"{KEY} to 1 or 2"):
        check_model(model, 4, KEY)
