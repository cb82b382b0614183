"""The MTP update (`lathe.train.mtp`) sharded: a tiny MiMo actor trained with `model.mtp.enable_train` on 2 gloo ranks
of plain FSDP2 (the MTP layers groups of their own: `lathe.train.parallel.decoder_layers`) and on one tensor-parallel
group of 2 (`lathe.train.tensor_parallel`: the MTP layers cut like the decoder layers, the MTP loss read through the
vocabulary-parallel lm_head) updates exactly as one process does."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_rel
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights

from .conftest import VOCAB
from .test_parallel import COMPARED, run_ranks, train

pytestmark = pytest.mark.slow

MTP = ("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
       "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.5", "actor_rollout_ref.model.use_remove_padding=true")
METRIC = "actor/mtp_losses/mtp_1_loss"


def mimo_model(layers: int = 1) -> LatheCausalLM:
    """MiMo-shaped (Qwen2 body, 2 layers, 4 query / 2 key-value heads, `layers` MTP layers), the same weights in
    every process."""
    cfg = LatheConfig.from_hf_dict({"architectures": ["MiMoForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
                                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "max_position_embeddings": 64,
                                    "tie_word_embeddings": False, "num_nextn_predict_layers": layers})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.2)
    return model


def mtp_job(world: int, *, tp: int = 1):
    overrides = MTP + ((f"actor_rollout_ref.actor.fsdp_config.tensor_parallel_size={tp}",) if tp > 1 else ())
    return train(world, -1, steps=range(2), overrides=overrides, tp=tp, model_fn=mimo_model)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    fsdp, tp = run_ranks(2, tmp_path_factory.mktemp("mtp"), dict(), dict(tp=2), fn=mtp_job)
    return fsdp[0], tp[0], mtp_job(1)


def _assert_same(actual: dict, expected: dict) -> None:
    for a, b in zip(actual["metrics"], expected["metrics"]):
        assert_close_rel([a[k] for k in (*COMPARED, METRIC)], [b[k] for k in (*COMPARED, METRIC)], rel=1e-5,
                         name="metrics")
    assert_close_rel(actual["weights"], expected["weights"], rel=1e-5, name="weights")


def test_fsdp_over_two_ranks_trains_the_mtp_layers_as_one_process(ranks):
    fsdp, _, one = ranks
    assert one["metrics"][0][METRIC] > 0
    assert not torch.equal(one["weights"]["model.mtp_layers.0.input_proj.weight"],
                           mimo_model().state_dict()["model.mtp_layers.0.input_proj.weight"])
    _assert_same(fsdp, one)


def test_a_tensor_parallel_group_trains_the_mtp_layers_as_one_process(ranks):
    _, tp, one = ranks
    assert tp["mesh"] is not None and 2 in tp["mesh"][0]
    _assert_same(tp, one)
