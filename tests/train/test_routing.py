"""Routing replay in the trainer (`lathe.train.routing`): with R3 the old-log-prob pass routes every token as the
engine did, though the trainer's router was perturbed since the rollout (packed and padded forwards, micro-batches
by count and by tokens); with R2 the update routes as the old-log-prob pass recorded, after an optimizer step moved
the router; without replay the routing would differ."""

import copy
from dataclasses import replace

import pytest
import torch

from lathe.batch import Batch
from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models import routing as model_routing
from lathe.models.hf import lathe_from_transformers
from lathe.models.routing import ReplayStats
from lathe.rollout.base import ROUTED, concat_rollouts, to_batch
from lathe.train.logprob import batched_token_stats
from lathe.train.routing import LogProbRouting, check_replay_model, replaying

from helpers import assert_close_rel
from models.lathe_tiny import MOE, hf_model

PROMPTS = [[5, 9, 2, 33, 7, 1, 8], [4, 4, 61, 12], [5, 9, 2, 33, 7, 1, 8, 90, 3, 17]]
PER_SAMPLE = ("token_ids", "logprobs", "finish_reasons", "routed_experts")


@pytest.fixture(scope="module")
def rollout():
    """(policy, batch): a rollout of the tiny MoE policy with its routing recorded, laid out by `to_batch`."""
    model = lathe_from_transformers(hf_model(MOE)).eval()
    engine = LatheEngine(copy.deepcopy(model), eos_token_id=[3, 7, 11, 19, 23, 40, 50, 60, 70], block_size=4,
                         num_kv_blocks=64, record_routing=True)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5))
    batch = to_batch(PROMPTS, out, pad_id=0, n=2)
    # joined from two rollouts of other widths (a data-parallel rollout, dynamic sampling): the same layout
    halves = [to_batch(PROMPTS[a:b], replace(out, **{k: getattr(out, k)[2 * a:2 * b] for k in PER_SAMPLE}), 0, 2)
              for a, b in ((0, 2), (2, 3))]
    joined = concat_rollouts(halves, pad_id=0)
    assert halves[0][ROUTED].shape[1] < joined[ROUTED].shape[1]
    assert all(torch.equal(joined[k], batch[k]) for k in (ROUTED, "input_ids", "attention_mask"))
    return model, batch


def _perturbed(model):
    out = copy.deepcopy(model)
    gate = out.model.layers[1].mlp.gate.weight
    with torch.no_grad():
        gate.add_(0.5 * gate.std() * torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)))
    return out


def _given(routed: torch.Tensor) -> torch.Tensor:
    """(B, L) whether each position has a choice for every layer."""
    return (routed >= 0).flatten(2).all(-1)


def _spy(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(given, chosen) of every replayed forward of the one MoE layer."""
    seen = []
    real = model_routing.replay_route

    def spy(probs, top_k, norm, given, **router):
        weights, chosen = real(probs, top_k, norm, given, **router)
        seen.append((given, chosen))
        return weights, chosen
    monkeypatch.setattr(model_routing, "replay_route", spy)
    return seen


def _assert_replayed(seen, full: torch.Tensor):
    """Every token with a given choice routed to it, and all of `full`'s choices were given."""
    given = torch.cat([g for g, _ in seen])
    chosen = torch.cat([c for _, c in seen])
    has = (given >= 0).all(-1)
    assert torch.equal(chosen[has], given[has].long())
    assert int(has.sum()) == int(_given(full).sum())


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("max_tokens", [None, 40], ids=["by_count", "by_tokens"])
def test_r3_old_log_prob_pass_routes_as_the_engine(rollout, monkeypatch, remove_padding, max_tokens):
    model, batch = rollout
    routed = batch[ROUTED]
    assert routed.shape == (*batch["input_ids"].shape, 1, 2) and routed.dtype == torch.int16
    assert (_given(routed) <= batch["attention_mask"].bool()).all()      # nothing recorded at padding
    trainer = _perturbed(model)
    native = _native(trainer, batch)
    real = _given(routed)
    assert not torch.equal(native[real].sort(-1).values, routed[real].long().sort(-1).values), \
        "precondition: the perturbed router routes some token otherwise"
    seen = _spy(monkeypatch)
    batched_token_stats(trainer, batch, micro_batch_size=2, remove_padding=remove_padding, max_tokens=max_tokens,
                        around=LogProbRouting("R3", trainer, remove_padding))
    _assert_replayed(seen, routed)


@torch.no_grad()
def _native(model, batch: Batch) -> torch.Tensor:
    """(B, L, 1, k) the model's own choices over the padded batch."""
    with model_routing.record_routing(model) as rec:
        model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    return rec[0][0].view(*batch["input_ids"].shape, 1, -1)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_r2_update_routes_as_the_old_log_prob_pass_recorded(rollout, monkeypatch, remove_padding):
    model, batch = rollout
    batch = Batch({k: v for k, v in batch.tensors.items() if k != ROUTED})
    policy = copy.deepcopy(model).train()
    recorder = LogProbRouting("R2", policy, remove_padding)
    batched_token_stats(policy, batch, micro_batch_size=3, remove_padding=remove_padding, max_tokens=30,
                        around=recorder)
    recorded = recorder.result()
    mask = batch["attention_mask"].bool()
    assert recorded.shape == (*mask.shape, 1, 2)
    if remove_padding:
        assert (_given(recorded) == mask).all()
    assert torch.equal(recorded[mask].long(), _native(policy, batch)[mask])      # the pass's own routing
    moved = _perturbed(policy).train()
    moved.gradient_checkpointing_enable()                  # recomputed layers replay too
    seen = _spy(monkeypatch)
    update = Batch({**batch.tensors, ROUTED: recorded}).select([4, 1, 0])
    stats = ReplayStats()
    with replaying(moved, update, remove_padding, stats):
        from lathe.train.logprob import response_log_probs
        logp, _ = response_log_probs(moved, update, remove_padding=remove_padding)
        logp.sum().backward()
    assert len(seen) == 2                                  # forward and its recomputation in backward
    _assert_replayed(seen[:1], update[ROUTED])
    assert torch.equal(seen[0][1], seen[1][1])
    given = int(_given(update[ROUTED]).sum())
    assert int(stats.given) == given and 0 < int(stats.changed) < int(stats.given)   # counted in the forward only


def test_dense_and_transformers_policies_are_refused():
    from models.lathe_tiny import hf_model as tiny
    dense = lathe_from_transformers(tiny("qwen3"))
    with pytest.raises(ValueError, match="dense model.*router_replay.mode=disabled"):
        check_replay_model(dense, "R3")
    with pytest.raises(ValueError, match="router_replay.mode=R2: routing replay drives lathe's MoE"):
        check_replay_model(tiny(MOE), "R2")


def test_prefix_grouped_passes_replay_and_record_as_the_per_row_passes(rollout):
    """`use_prefix_grouper` (each prompt once, then its rows' responses): R3 replays the engine's choices in the
    grouped stream's order (a prompt's from its group's first row; the engine's shared prefix gave every row the same),
    so the grouped pass's log-probs under a perturbed router are the per-row pass's; R2 records a grouped pass's
    choices into every row (the prompt's into each row of its group): the per-row pass's recording, and an update
    replaying it grouped gives the per-row update's log-probs and gradients."""
    from lathe.train.logprob import response_log_probs
    model, batch = rollout
    real = _given(batch[ROUTED])
    for rows in ((0, 1), (2, 3), (4, 5)):          # the engine's shared prefix: one routing for a prompt's rows
        prompt = real[rows[0], :batch["prompts"].shape[1]]
        assert torch.equal(batch[ROUTED][rows[0], :prompt.shape[0]][prompt],
                           batch[ROUTED][rows[1], :prompt.shape[0]][prompt])
    trainer = _perturbed(model)
    r3 = {grouped: batched_token_stats(trainer, batch, micro_batch_size=4, remove_padding=True,
                                       prefix_grouper=grouped,
                                       around=LogProbRouting("R3", trainer, True, grouped=grouped))[0]
          for grouped in (False, True)}
    mask = batch["response_mask"].bool()
    assert_close_rel(r3[True][mask], r3[False][mask], name="R3 log-probs")
    unreplayed = batched_token_stats(trainer, batch, micro_batch_size=4, remove_padding=True, prefix_grouper=True)[0]
    assert not torch.allclose(unreplayed[mask], r3[True][mask]), "precondition: replay changes the log-probs"

    plain = Batch({k: v for k, v in batch.tensors.items() if k != ROUTED})
    policy = copy.deepcopy(model).train()
    recorded = {}
    for grouped in (False, True):
        recorder = LogProbRouting("R2", policy, True, grouped=grouped)
        batched_token_stats(policy, plain, micro_batch_size=4, remove_padding=True, prefix_grouper=grouped,
                            around=recorder)
        recorded[grouped] = recorder.result()
    assert torch.equal(recorded[True], recorded[False])           # every real position, -1 at the padding
    moved = _perturbed(policy).train()
    out = {}
    for grouped in (False, True):
        update = Batch({**plain.tensors, ROUTED: recorded[True]})
        with replaying(moved, update, True, grouped=grouped):
            logp, _ = response_log_probs(moved, update, remove_padding=True, prefix_grouper=grouped)
            logp.sum().backward()
        out[grouped] = (logp.detach(), {k: p.grad.clone() for k, p in moved.named_parameters() if p.grad is not None})
        moved.zero_grad()
    assert_close_rel(out[True][0][mask], out[False][0][mask], name="R2 log-probs")
    assert_close_rel(out[True][1], out[False][1], name="R2 gradients")
