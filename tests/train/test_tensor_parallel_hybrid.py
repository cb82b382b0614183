"""lathe.train.tensor_parallel with Qwen3.5's hybrid layers (gated-DeltaNet linear attention beside gated full
attention): a tiny Qwen3.5, a tiny Qwen3.5-MoE (its routed experts over the group, expert parallelism of the same
size; its shared expert cut as an MLP) and a tiny Qwen3-Next (fused linear-attention projections, a dense layer and a
sparse one) cut over a tensor-parallel group of 2 (gloo, float64; 1 of the 2 linear key heads and 2 of the 4 value
heads a rank) give the one-process logits, loss and parameter gradients on a packed batch, a padded one and a
prefix-grouped stream (a cut parameter's gradient gathered whole); the sizes and layouts it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import assert_close_rel, spawn_saving_ranks, gloo_rank

from lathe.models.attention import PackedAttention, PaddedAttention
from lathe.models.hf import lathe_from_transformers

from models.lathe_tiny import hf_model, hybrid_config

from lathe.train.prefix_group import grouped_layout

from .test_prefix_group import _grouped_batch
from .test_ulysses_hybrid import LENGTHS, family_runs, inputs   # (the packed batch: 4 sequences, 19 tokens)

T, JOIN_S = 2, 120
KEY = "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size"


def padded_inputs():
    """The same sequences as right-padded rows (the padded forward: each row from a zero state, padding zeroed)."""
    ids, _, cu, w = inputs()
    rows, width = len(LENGTHS), max(LENGTHS)
    grid, mask = torch.zeros(rows, width, dtype=ids.dtype), torch.zeros(rows, width, dtype=torch.long)
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        grid[r, :b - a], mask[r, :b - a] = ids[a:b], 1
    return grid, mask, (mask.cumsum(-1) - 1).clamp(min=0), w


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(model) -> dict:
    """Logits, loss sum(logits * w) and every parameter's gradient (whole), packed, padded and prefix-grouped (3
    prompts x 3 responses as one stream: `lathe.train.prefix_group`, the linear layers' `GroupedLinear` too)."""
    out = {}
    ids, pos, cu, w = inputs()
    grid, mask, positions, _ = padded_inputs()
    cfg = model.config
    stream = grouped_layout(_grouped_batch(n=3), cfg.linear_attention.conv_kernel if cfg.nemotron is None
                            else cfg.nemotron.mamba.conv_kernel)
    forwards = {"packed": lambda m: m.lm_head(m.hidden_with(ids, pos, PackedAttention(cu, max(LENGTHS)))),
                "padded": lambda m: m.lm_head(m.hidden_with(grid, positions, PaddedAttention(mask)))[mask.bool()],
                "grouped": lambda m: m.lm_head(m.hidden_with(stream.input_ids, stream.position_ids,
                                                             stream.attention("sdpa")))}
    for name, forward in forwards.items():
        model.zero_grad()
        logits = whole(forward(model))
        weights = w if name != "grouped" else torch.randn(logits.shape, dtype=logits.dtype,
                                                          generator=torch.Generator().manual_seed(1))
        loss = (logits * weights).sum()
        loss.backward()
        out[name] = {"logits": logits.detach(), "loss": loss.detach(),
                     "grads": {n: whole(p.grad).clone() for n, p in model.named_parameters()}}
    return out


def rank_main(rank: int, port: int, root: str, queue) -> None:
    def work():
        from torch.distributed.device_mesh import init_device_mesh
        from lathe.train import expert_parallel
        from lathe.train.tensor_parallel import TensorParallel, check_model, parallelize
        mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("tp",))
        tp = TensorParallel(size=T, rank=mesh.get_local_rank(), mesh=mesh, group=mesh.get_group(), data_group=None)
        ep = expert_parallel.ExpertParallel(size=T, rank=tp.rank, mesh=mesh, group=tp.group, same_tokens=True)
        res = {}
        for family, model in torch.load(Path(root) / "models.pt", weights_only=False).items():
            moe = family in MOE                        # its experts over the group, expert parallelism of T
            check_model(model, T, KEY, experts=T if moe else 1)
            parallelize(model, tp)
            if moe:                                    # (the shared expert cut, not left whole)
                shared = (model.model.layers[-1].mixer.shared_experts.up_proj if family == "nemotron_h" else
                          model.model.layers[-1].mlp.shared_expert.gate_proj)
                assert hasattr(shared.weight, "placements")
            res[family] = run(expert_parallel.parallelize(model, ep if moe else None))
        torch.save(res, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, T, port, queue, work, JOIN_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one-process results, each rank's) by family: Qwen3.5, and Qwen3.5-MoE (4 experts, top-2, a shared expert)."""
    return family_runs(tmp_path_factory.mktemp("tp_hybrid"), FAMILIES, run, rank_main, T,
                       [__name__, "lathe.models.qwen3_5", "lathe.train.tensor_parallel", "lathe.train.expert_parallel"])


# (Nemotron-H: Mamba2, MoE, attention, MLP, Mamba2, MoE layers; 2 groups of 2 Mamba2 heads, 1 group a rank)
FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h")
MOE = ("qwen3_5_moe_text", "qwen3_next", "nemotron_h")           # (Qwen3-Next's layer 1 sparse, layer 0 dense)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", ["packed", "padded", "grouped"])
def test_a_group_of_two_equals_one_process(runs, batch, family):
    want, ranks = runs
    want = want[family][batch]
    for rank, got in enumerate(ranks):
        got = got[family][batch]
        # (the decay gate and the zero-centred norms compute in float32 on both sides, and the group's sums reorder
        # their rounding: the q/k norms' gradients come out ~1.5e-7 apart, other head layouts' logits ~1e-8, and
        # Qwen3-Next's packed loss, one scalar over all of them, 1.9e-7 on one 2-core run)
        assert_close_rel(got["logits"], want["logits"], 1e-7, name=f"rank {rank}'s {batch} logits")
        assert_close_rel(got["loss"], want["loss"], 1e-6, name=f"rank {rank}'s {batch} loss")
        assert_close_rel(got["grads"], want["grads"], 1e-6, name=f"rank {rank}'s {batch} gradients")
    if family == "nemotron_h":
        for name in ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight", "in_proj.weight",
                     "out_proj.weight"):
            assert want["grads"]["model.layers.0.mixer." + name].abs().min() > 0, name
        for name in ("1.mixer.gate.weight", "1.mixer.shared_experts.down_proj.weight", "2.mixer.q_proj.weight",
                     "3.mixer.down_proj.weight"):
            assert want["grads"]["model.layers." + name].abs().sum() > 0, name
        return
    linear, full = "model.layers.0.linear_attn.", "model.layers.1.self_attn."
    projections = (("in_proj_qkvz.weight", "in_proj_ba.weight") if family == "qwen3_next" else
                   ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"))
    for name in ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "out_proj.weight", *projections):
        assert want["grads"][linear + name].abs().sum() > 0, name
    assert want["grads"][full + "q_norm.weight"].abs().sum() > 0
    if family in MOE:
        for name in ("gate.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"):
            assert want["grads"]["model.layers.1.mlp." + name].abs().sum() > 0, name


# -- sharded by FSDP2 as `lathe train` shards it: the whole weights over the group's ranks too ----------------------
WHOLE = {"qwen3_5_text": ("linear_attn", "in_proj_qkv"), "nemotron_h": ("mixer", "in_proj")}   # (the conv too)


def rank_fsdp(rank: int, port: int, root: str, queue) -> None:
    """The tiny Qwen3.5 (and Nemotron-H) cut over a group of 2, then sharded by `shard_model` on the mesh plan 1 x 1 x
    TP 2: its in_proj_qkv (in_proj) and convolution, whole weights of which each rank takes rows, sharded over the
    group's 2 ranks (Nemotron-H's convolution bias with its weight)."""
    def work():
        from lathe.config.plan import MeshPlan
        from lathe.train import parallel
        from lathe.train.tensor_parallel import parallelize, tensor_parallel
        plan, cpu = MeshPlan(dp_replicate=1, dp_shard=1, tp=T), torch.device("cpu")
        out = {}
        for family, model in torch.load(Path(root) / "models.pt", weights_only=False).items():
            parallel.shard_model(parallelize(model, tensor_parallel(plan, cpu)), mesh=plan, device=cpu)
            mixer, proj = WHOLE[family]
            linear = getattr(model.model.layers[0], mixer)
            rows = {name: (w.to_local().shape[0], w.shape[0]) for name, w in
                    ((proj, getattr(linear, proj).weight), ("conv1d", linear.conv1d.weight))}
            out[family] = {"rows": rows, **run(model)}
        torch.save(out, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, T, port, queue, work, JOIN_S)


def test_under_fsdp2_the_whole_weights_shard_over_the_group_and_it_equals_one_process(tmp_path):
    want, ranks = family_runs(tmp_path, tuple(WHOLE), run, rank_fsdp, T,
                              [__name__, "lathe.models.qwen3_5", "lathe.train.tensor_parallel"])
    for family, (mixer, proj) in WHOLE.items():
        for rank, got in enumerate(ranks):
            got = got[family]
            assert all(local * T == whole for local, whole in got["rows"].values()), got["rows"]
            for batch in ("packed", "padded"):
                assert_close_rel(got[batch]["logits"], want[family][batch]["logits"], 1e-7,
                                 name=f"{family} rank {rank}'s {batch} logits")
                assert_close_rel(got[batch]["grads"], want[family][batch]["grads"], 1e-6,
                                 name=f"{family} rank {rank}'s {batch} gradients")
        for name in (f"{proj}.weight", "conv1d.weight"):
            assert want[family]["packed"]["grads"][f"model.layers.0.{mixer}.{name}"].abs().sum() > 0, name


# -- beside Ulysses: TP 2 x SP 2 on 4 ranks (the tp pairs consecutive, the sp pairs 2 apart) -------------------------
def wide_hybrid():
    """A tiny Qwen3.5 with 4 linear key heads and 8 value heads: 1 key head and 2 value heads a rank of TP 2 x SP 2."""
    from transformers import AutoModelForCausalLM
    cfg = hybrid_config("qwen3_5_text")
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = 4, 8
    torch.manual_seed(5)
    return lathe_from_transformers(AutoModelForCausalLM.from_config(cfg)).double().train()


def rank_tp_sp(rank: int, port: int, root: str, queue) -> None:
    """This rank's slice of the packed batch through the model cut over its TP pair, its Ulysses pair's logits
    gathered, every gradient whole and summed over the Ulysses pair (as FSDP2's reduce-scatter sums them)."""
    def work():
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from lathe.train import ulysses
        from lathe.train.tensor_parallel import TensorParallel, check_model, parallelize
        mesh = init_device_mesh("cpu", (2, T), mesh_dim_names=("dp", "tp"))["tp"]
        tp = TensorParallel(size=T, rank=mesh.get_local_rank(), mesh=mesh, group=mesh.get_group(), data_group=None)
        sp = ulysses.sequence_parallel(2, tp=T)
        model = torch.load(Path(root) / "wide.pt", weights_only=False)
        check_model(model, T, KEY)
        ulysses.check_model(model, 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", T, KEY)
        parallelize(model, tp)
        ids, pos, cu, w = inputs()
        n = len(ids)
        bounds = torch.cat([cu, torch.tensor([ulysses.padded_length(n, sp.size)], dtype=torch.int32)])
        attn = ulysses.UlyssesAttention(PackedAttention(bounds, max(LENGTHS)), sp)
        hidden = model.hidden_with(ulysses.local_slice(ids, sp), ulysses.local_slice(pos, sp), attn)
        logits = ulysses.gather_tokens(whole(model.lm_head(hidden)), sp)[:n]
        loss = (logits * w).sum()
        loss.backward()
        grads = {name: whole(p.grad).clone() for name, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=sp.group)
        torch.save({"logits": logits.detach(), "loss": loss.detach(), "grads": grads}, Path(root) / f"rank{rank}.pt")
    gloo_rank(rank, 2 * T, port, queue, work, JOIN_S)


def test_beside_ulysses_a_block_of_four_equals_one_process(tmp_path):
    model = wide_hybrid()
    torch.save(model, tmp_path / "wide.pt")
    want = run(model)["packed"]
    ranks = spawn_saving_ranks(rank_tp_sp, 2 * T, tmp_path, [__name__, "lathe.models.qwen3_5",
                                                             "lathe.train.tensor_parallel", "lathe.train.ulysses"],
                               JOIN_S)
    for rank, got in enumerate(ranks):
        assert_close_rel(got["logits"], want["logits"], 1e-7, name=f"rank {rank}'s logits")
        assert_close_rel(got["loss"], want["loss"], 1e-7, name=f"rank {rank}'s loss")
        assert_close_rel(got["grads"], want["grads"], 1e-6, name=f"rank {rank}'s gradients")


def tiny():
    return lathe_from_transformers(hf_model("qwen3_5_text"))


def test_sizes_and_layouts_it_cannot_cut_are_refused():
    """The tiny Qwen3.5 has 2 linear key heads, 4 value heads (and 4 query / 2 key-value heads)."""
    from lathe.train import tensor_parallel, ulysses
    model = tiny()
    tensor_parallel.check_model(model, 2, KEY)
    with pytest.raises(ValueError, match=rf"{KEY}=4: Qwen3_5ForCausalLM's linear-attention layers have 2 key heads "
                                         rf"and 4 value heads.*Fix: set {KEY} to one of \[1, 2\]"):
        tensor_parallel.check_model(model, 4, KEY)
    from transformers import AutoModelForCausalLM
    odd = lathe_from_transformers(AutoModelForCausalLM.from_config(
        hybrid_config("qwen3_5_text", linear_num_key_heads=3, linear_num_value_heads=3)))
    with pytest.raises(ValueError, match=rf"{KEY}=2: Qwen3_5ForCausalLM's linear-attention layers have 3 key heads "
                                         rf"and 3 value heads.*Fix: set {KEY} to one of \[1, 3\]"):
        tensor_parallel.check_model(odd, 2, KEY)
    sp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    with pytest.raises(ValueError, match=rf"{sp_key}=2: Qwen3_5ForCausalLM's linear-attention layers have 1 key heads "
                                         rf"per rank of a tensor-parallel group of 2 .*Fix: set {sp_key} to 1"):
        ulysses.check_model(model, 2, sp_key, 2, KEY)      # 2 key heads: 1 a TP rank, which SP 2 cannot split
    cfg = hybrid_config("qwen3_5_moe_text")
    cfg.shared_expert_intermediate_size = 25
    narrow = lathe_from_transformers(AutoModelForCausalLM.from_config(cfg))
    with pytest.raises(ValueError, match=rf"{KEY}=2: .*25 shared_expert_intermediate_size"):
        tensor_parallel.check_model(narrow, 2, KEY, experts=2)


def test_a_lora_adapter_on_the_whole_projection_is_refused():
    from lathe.models.lora import apply_lora
    from lathe.train import tensor_parallel
    model = tiny()
    apply_lora(model, rank=4, alpha=8, target_modules=["in_proj_qkv", "out_proj"])
    with pytest.raises(ValueError, match="LoRA adapter on the linear-attention layers' in_proj_qkv"):
        tensor_parallel.check_model(model, 2, KEY)


def test_nemotron_h_groups_must_split_over_the_group():
    """The tiny Nemotron-H has 2 groups of 2 Mamba2 heads: TP 2 cuts them, 4 is refused; so is an adapter on in_proj,
    and Ulysses beside TP 2 (one group a rank)."""
    from lathe.models.lora import apply_lora
    from lathe.train import tensor_parallel, ulysses
    from models.nemotron_tiny import nemotron_model
    model = lathe_from_transformers(nemotron_model())
    tensor_parallel.check_model(model, 2, KEY, experts=2)
    with pytest.raises(ValueError, match=rf"{KEY}=4: NemotronHForCausalLM's Mamba2 layers have 2 groups of heads "
                                         rf"\(n_groups\).*Fix: set {KEY} to one of \[1, 2\]"):
        tensor_parallel.check_model(model, 4, KEY, experts=4)
    sp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    with pytest.raises(ValueError, match=rf"{sp_key}=2: NemotronHForCausalLM's Mamba2 layers have 1 groups of heads "
                                         rf"\(n_groups\) per rank of a tensor-parallel group of 2"):
        ulysses.check_model(model, 2, sp_key, 2, KEY)
    apply_lora(model, rank=2, alpha=4, target_modules=["in_proj", "q_proj"])
    with pytest.raises(ValueError, match=r"LoRA adapter on the Mamba2 layers' in_proj"):
        tensor_parallel.check_model(model, 2, KEY, experts=2)
