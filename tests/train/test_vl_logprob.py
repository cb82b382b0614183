"""Vision-language models in the trainer (issue 17): packed and padded log-probs of prompt+response rows with images
equal the teacher-forced log-probs of one padded forward, however the batch is cut into micro-batches (each
micro-batch must carry its own rows' images and 3D positions); a PPO update does not depend on the cut."""

import numpy as np
import pytest
import torch

from lathe.config import batch_plan, load_config
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch
from lathe.train.actor import PPOActor
from lathe.train.logprob import batched_log_probs, response_log_probs
from lathe.train.optim import build_scheduler

from helpers import assert_close_rel
from models.vl_tiny import IMAGE, VISION_START, save_hf, text_and_image_prompts

from .conftest import UPDATE_REL

PAD = 0
TEMPERATURE = 0.7
# (grids of the row's images) per row: text, one image, two images, text, one image, one image
ROW_GRIDS = [[], [(1, 4, 4)], [(1, 4, 6), (1, 6, 4)], [], [(1, 6, 6)], [(1, 4, 4)]]


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    """family -> a tiny lathe VL model loaded from a transformers-saved checkpoint (built once per module)."""
    from lathe.models.vl import load_lathe_vl_model
    cache = {}

    def get(family):
        if family not in cache:
            path, _ = save_hf(tmp_path_factory.mktemp("vl"), family)
            cache[family] = load_lathe_vl_model(path).eval()
        return cache[family]
    return get


def vl_rollout_batch(seed: int = 0):
    """`to_batch` rows (left-padded prompts with image placeholders, right-padded text responses) plus the
    per-row `multi_modal_inputs` column (None for text rows), as `prompt_batch` + the rollout build it."""
    g = torch.Generator().manual_seed(seed)
    prompts, mm = text_and_image_prompts(ROW_GRIDS, g, lambda g: int(torch.randint(2, 6, (1,), generator=g)))

    def text(n):
        return torch.randint(3, VISION_START, (n,), generator=g).tolist()

    responses = [text(int(torch.randint(1, 7, (1,), generator=g))) for _ in prompts]
    out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * len(prompts))
    batch = to_batch(prompts, out, PAD, n=1)
    batch["multi_modal_inputs"] = mm
    return batch


def teacher_forced(model, batch):
    """(B, R) log-probs of the responses from ONE padded `forward` over the whole batch (all images at once)."""
    present = [m for m in batch["multi_modal_inputs"] if m is not None]
    pixels = torch.cat([m["pixel_values"] for m in present])
    grids = torch.cat([m["image_grid_thw"] for m in present])
    R = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], pixel_values=pixels,
                       image_grid_thw=grids).logits[:, -R - 1:-1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return logp * batch["response_mask"]


@pytest.mark.parametrize("family,remove_padding", [("qwen2_5_vl", True), ("qwen3_vl", True), ("qwen3_vl", False),
                                                   ("qwen3_5", True), ("qwen3_5", False)])
def test_log_probs_follow_their_rows_images_under_micro_batching(vl_models, family, remove_padding):
    vl_model = vl_models(family)
    batch = vl_rollout_batch()
    expected = teacher_forced(vl_model, batch)
    mask = batch["response_mask"]
    cuts = [dict(micro_batch_size=1), dict(micro_batch_size=3)]
    if remove_padding:                                       # packed by a token budget: rows regrouped out of order
        cuts.append(dict(micro_batch_size=1, max_tokens=40))
    for cut in cuts:
        logp, entropy = batched_log_probs(vl_model, batch, temperature=TEMPERATURE, calculate_entropy=True,
                                          remove_padding=remove_padding, **cut)
        assert_close_rel(logp * mask, expected, 1e-5, name=f"log-probs {cut}, remove_padding={remove_padding}")
        assert bool(torch.isfinite(entropy).all())
    if not remove_padding:
        return
    # the images matter: giving row 1 the pixels of row 5 (same grid) changes its log-probs
    swapped = batch.select(np.arange(len(batch)))
    mm = list(swapped["multi_modal_inputs"])
    mm[1] = mm[5]
    swapped["multi_modal_inputs"] = mm
    logp, _ = batched_log_probs(vl_model, swapped, micro_batch_size=6, temperature=TEMPERATURE,
                                remove_padding=True)
    assert float((logp[1] - expected[1]).abs().max()) > 1e-4


def _ppo_batch(model, seed=0):
    batch = vl_rollout_batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch["response_mask"].float()
    with torch.no_grad():
        logp, _ = response_log_probs(model.eval(), batch, temperature=TEMPERATURE, remove_padding=True)
    shape = mask.shape
    batch["old_log_probs"] = (logp + 0.3 * torch.randn(shape, generator=g)) * mask
    batch["advantages"] = torch.randn(shape[0], 1, generator=g).expand(shape) * mask
    return batch


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_update_runs_and_does_not_depend_on_micro_batch_size(vl_models, family):
    """One GRPO-style PPO update (one mini-batch of all 6 rows) of Qwen3-VL (deepstack included) and Qwen3.5 (hybrid
    layers; -MoE's experts): micro-batches of 1 row and of all rows give the same update, loss and gradient norm, and
    the weights move (vision tower included)."""
    vl_model = vl_models(family)
    cfg = load_config(None, ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=3", "algorithm.adv_estimator=grpo",
                             "actor_rollout_ref.actor.entropy_coeff=0.01",
                             f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
                             "actor_rollout_ref.actor.grad_clip=1000.0"])
    arr = cfg.actor_rollout_ref
    start = {k: v.detach().clone() for k, v in vl_model.state_dict().items()}
    batch = _ppo_batch(vl_model)
    results = {}
    for micro in (1, 6):
        vl_model.load_state_dict(start)
        arr.actor.ppo_micro_batch_size_per_gpu = micro
        optimizer = torch.optim.SGD(vl_model.parameters(), lr=0.1)
        actor = PPOActor(vl_model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                         mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                         temperature=TEMPERATURE, max_response_length=cfg.data.max_response_length,
                         use_remove_padding=True)
        metrics = actor.update_policy(batch)
        results[micro] = ({k: v.detach() - start[k] for k, v in vl_model.state_dict().items()}, metrics)
    vl_model.load_state_dict(start)
    vl_model.eval()
    one, whole = results[1], results[6]
    assert max(float(d.abs().max()) for d in whole[0].values()) > 1e-4, "the update moves the weights"
    assert any(float(d.abs().max()) > 0 for k, d in whole[0].items() if k.startswith("model.visual.")), \
        "the vision tower gets gradients through the image tokens"
    assert_close_rel(one[0], whole[0], UPDATE_REL, name="update, micro-batch 1 vs 6")
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert one[1][key] == pytest.approx(whole[1][key], rel=1e-5, abs=1e-7), key


def test_trainer_log_probs_equal_the_engines_with_generated_image_tokens(vl_models):
    """The trainer recomputes the engine's log-probs of a rollout (fp32), also where the policy generated image
    placeholder tokens: in a response they are text at text positions (index + the prompt's rope delta) for both.
    The image token's lm_head row is scaled up so that samples hold it often."""
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    model = vl_models("qwen2_5_vl")
    batch = vl_rollout_batch(3)
    prompts = [[t for t, m in zip(row.tolist(), keep.tolist()) if m]
               for row, keep in zip(batch["prompts"], batch["attention_mask"][:, :batch["prompts"].shape[1]])]
    inputs = list(batch["multi_modal_inputs"])
    original = model.lm_head.weight[IMAGE].clone()
    with torch.no_grad():
        model.lm_head.weight[IMAGE] *= 6
    try:
        engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=256)
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7),
                              multi_modal_inputs=inputs)
        generated = sum(t == IMAGE for ids in out.token_ids for t in ids)
        assert generated >= 3, "precondition: the policy generated image tokens"
        rollout = to_batch(prompts, out, PAD, 2)
        rollout.non_tensors["multi_modal_inputs"] = [m for m in inputs for _ in range(2)]
        for packed in (True, False):
            logp, _ = response_log_probs(model, rollout, remove_padding=packed)
            got = logp[rollout["response_mask"].bool()]
            want = torch.tensor([x for row in out.logprobs for x in row])
            assert_close_rel(got, want, name=f"trainer vs engine log-probs (packed={packed})", rel=1e-4)
    finally:
        with torch.no_grad():
            model.lm_head.weight[IMAGE] = original
