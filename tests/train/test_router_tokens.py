"""lathe.train.router_tokens: the routers' statistics of a micro-batch are those of its real tokens, whatever the
forward routes besides them. In float64, on a tiny Qwen3-MoE (2 sparse layers): a micro-batch with ghost rows
(`lathe.cluster.dispatch.select_share`) gives the load-balancing loss, Megatron's switch loss and z-loss, and their
gradients (beside the log-probs'), of the same micro-batch without them, packed and padded (padding left out as
well, so both forwards agree); and a sequence-parallel rank's slice keeps its share of the same tokens."""

from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close_rel

from lathe.batch import GHOST
from lathe.cluster.dispatch import select_share
from lathe.generation import RolloutOutput
from lathe.models.moe import collect_router_stats
from lathe.rollout.base import to_batch
from lathe.train.logprob import response_log_probs
from lathe.train.router_tokens import router_tokens

from .conftest import PAD, VOCAB
from .test_expert_parallel import tiny_moe

REL = 1e-10              # float64: two sums of the same terms in another order


def ragged(rows: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: [torch.randint(2, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist() for _ in range(rows)]
    prompts, responses = ids(2, 7), ids(1, 8)
    return to_batch(prompts, RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * rows), PAD, n=1)


@pytest.fixture(scope="module")
def model():
    return tiny_moe().double().train()


def router_losses(model, batch, *, remove_padding: bool, counted: bool = True):
    """(aux, switch, z, tokens per layer, gradients by name) of the log-probs' sum plus every router loss."""
    model.zero_grad()
    with collect_router_stats(model, keep_logits=True) as stats:
        stats.token_index = router_tokens(batch) if counted else None
        logp, _ = response_log_probs(model, batch, remove_padding=remove_padding)
    aux, (switch, z) = stats.aux_loss(), stats.megatron_losses()
    ((logp * batch["response_mask"]).sum() + aux + 0.3 * switch + 0.01 * z).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.stack([aux, switch, z]).detach(), stats.layer_rows, grads


@pytest.mark.parametrize("path", ["packed", "padded_mask", "padded_unpad"])
def test_ghost_rows_leave_the_router_losses_and_gradients_as_they_were(model, path):
    batch = ragged()
    ghosts = select_share(batch, [0, -1, 1, 2, 3, -1])          # two ghost rows, one between real rows
    assert ghosts[GHOST].tolist() == [False, True, False, False, False, True]
    model.padded_attention = "unpad" if path == "padded_unpad" else "mask"
    want, rows, grads = router_losses(model, batch, remove_padding=True)
    got, got_rows, got_grads = router_losses(model, ghosts, remove_padding=path == "packed")
    real = int(batch["attention_mask"].sum())
    assert rows == got_rows == [real, real]                      # each sparse layer: the real rows' real tokens
    assert_close_rel(got, want, rel=REL, name="aux, switch and z losses")
    assert_close_rel(got_grads, grads, rel=REL, name="gradients")
    routers = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers)
    # counted as the forward routes them, the ghost rows (and a padded forward's padding) would change the losses
    every, _, _ = router_losses(model, ghosts, remove_padding=path == "packed", counted=False)
    assert float((every - want).abs().max()) > 1e-4


def test_a_micro_batch_without_padding_or_ghost_rows_needs_no_index():
    full = to_batch([[2, 3], [4, 5]], RolloutOutput([[6, 7, 8], [9, 10, 11]], [[0.0] * 3] * 2, ["stop"] * 2), PAD, n=1)
    assert bool(full["attention_mask"].all()) and router_tokens(full) is None
    assert router_tokens(select_share(full, [0, 1, -1])) is not None           # a ghost row: indices again


@dataclass(frozen=True)
class Place:            # a sequence-parallel rank's place (`lathe.train.ulysses.SequenceParallel`) without a group
    size: int
    rank: int


@pytest.mark.parametrize("size", [2, 3])
def test_sequence_parallel_slices_keep_their_share_of_the_counted_tokens(size):
    ghosts = select_share(ragged(), [0, -1, 1, 2, 3])
    real = ghosts["attention_mask"].bool()
    packed = (real & ~ghosts[GHOST].unsqueeze(-1))[real]
    per = -(-len(packed) // size)
    slices = [router_tokens(ghosts, Place(size, r)) for r in range(size)]
    assert all(list(s) == [per] for s in slices)
    joined = torch.cat([s[per] + r * per for r, s in enumerate(slices)])
    assert torch.equal(joined, torch.nonzero(packed).flatten())
