"""Routing replay's engine side (`lathe.engine.routing`): the MoE choices the engine records for each token are the
ones a teacher-forced forward of the same tokens makes (prefix sharing, copied blocks, chunked prefill and
preemption included),
and replaying them makes a perturbed router route as the engine did."""

import copy

import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models.hf import lathe_from_transformers
from lathe.models.moe import sparse_blocks
from lathe.models.routing import record_routing, replay_routing

from models.lathe_tiny import MOE, hf_model

PROMPTS = [[5, 9, 2, 33, 7, 1, 8], [4, 4, 61, 12], [5, 9, 2, 33, 7, 1, 8, 90, 3, 17]]


def _rollout(model, **kw):
    kw.setdefault("num_kv_blocks", 64)
    engine = LatheEngine(copy.deepcopy(model), eos_token_id=None, block_size=4, record_routing=True, **kw)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=3))
    assert (engine.scheduler.num_preemptions > 0) == (kw["num_kv_blocks"] < 64)
    return out


@torch.no_grad()
def _forward_routing(model, ids: list[int]) -> torch.Tensor:
    with record_routing(model) as rec:
        model(torch.tensor([ids]))
    return torch.stack([layer[0] for layer in rec], dim=1)          # (T, layers, k)


@torch.no_grad()
def _replayed(model, ids: list[int], given: torch.Tensor) -> torch.Tensor:
    """The experts the (one) MoE layer routed to under `replay_routing(given)`."""
    seen = []
    with replay_routing(model, given):
        block = sparse_blocks(model)[0]
        hook = block.routing
        block.routing = lambda *a, **kw: seen.append(hook(*a, **kw)) or seen[-1]
        model(torch.tensor([ids]))
    return seen[0][1]


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(-1).values.long(), b.sort(-1).values.long())


def test_recorded_routing_equals_the_forward_of_the_same_tokens():
    model = lathe_from_transformers(hf_model(MOE)).eval()
    for kw in ({}, {"enable_prefix_caching": False, "max_num_batched_tokens": 8,     # shared prefixes; chunks,
                    "num_kv_blocks": 8, "reserve_new_tokens": False}):               # preempted and recomputed
        out = _rollout(model, **kw)
        prompts = [p for p in PROMPTS for _ in range(2)]
        assert len(out.routed_experts) == len(prompts)
        for prompt, resp, rec in zip(prompts, out.token_ids, out.routed_experts):
            ids = prompt + resp
            assert rec.dtype == torch.int16 and rec.shape == (len(ids), 1, 2)
            assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()       # the last token is never fed
            assert _same_sets(rec[:-1], _forward_routing(model, ids)[:-1])


def test_replay_routes_a_perturbed_router_as_the_engine_did():
    model = lathe_from_transformers(hf_model(MOE)).eval()
    out = _rollout(model)
    trainer = copy.deepcopy(model)
    gate = trainer.model.layers[1].mlp.gate.weight
    with torch.no_grad():
        gate.add_(0.5 * gate.std() * torch.randn_like(gate, generator=torch.Generator().manual_seed(0)))
    differ = 0
    for prompt, resp, rec in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.routed_experts):
        ids = prompt + resp
        differ += int(not _same_sets(rec[:-1], _forward_routing(trainer, ids)[:-1]))
        assert _same_sets(rec[:-1, 0], _replayed(trainer, ids, rec)[:-1])
    assert differ, "precondition: the perturbed router routes some token otherwise"


def test_deepseek_records_and_replays_its_group_limited_choice(tmp_path):
    """DeepSeek-V3's router chooses within groups of experts with a selection bias and weighs by its sigmoid scores
    (`DeepseekMoeBlock.choose` / `weigh`): the engine records that choice for every token, and replay makes a
    perturbed router take it."""
    from models.deepseek_tiny import deepseek_model

    from lathe.models import load_lathe_model
    deepseek_model(seed=2).save_pretrained(tmp_path / "ckpt")
    model = load_lathe_model(tmp_path / "ckpt").eval()
    out = _rollout(model)
    trainer = copy.deepcopy(model)
    gate = sparse_blocks(trainer)[0].gate.weight
    with torch.no_grad():
        gate.add_(0.5 * gate.std() * torch.randn_like(gate, generator=torch.Generator().manual_seed(0)))
    differ = 0
    for prompt, resp, rec in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.routed_experts):
        ids = prompt + resp
        assert rec.shape == (len(ids), 2, 3)                              # 2 sparse layers, top-3
        assert _same_sets(rec[:-1], _forward_routing(model, ids)[:-1])
        differ += int(not _same_sets(rec[:-1], _forward_routing(trainer, ids)[:-1]))
        assert _same_sets(rec[:-1, 0], _replayed(trainer, ids, rec)[:-1])
    assert differ, "precondition: the perturbed router routes some token otherwise"


def test_forked_samples_of_a_hybrid_moe_record_their_prompts_routing(tmp_path):
    """Qwen3.5-MoE (linear-attention layers, prefix caching off): a prompt's samples fork from the first once its
    prompt is computed (`Scheduler`), sharing its blocks and so the routing recorded there; every sample's record is
    a teacher-forced forward's choice, the partial block's copies and a chunked prefill included."""
    from models.lathe_tiny import save_hf

    from lathe.models import load_lathe_model
    path, _ = save_hf(tmp_path, "qwen3_5_moe_text")
    model = load_lathe_model(path).eval()
    out = _rollout(model, max_num_batched_tokens=6)
    for prompt, resp, rec in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.routed_experts):
        ids = prompt + resp
        assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()
        assert _same_sets(rec[:-1], _forward_routing(model, ids)[:-1])
