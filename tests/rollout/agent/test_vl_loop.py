"""The agent loop with image prompts (Qwen2.5-VL), on lathe's engine: every turn of a trajectory carries its prompt's
images (encoded once per prompt), later turns find the earlier ones in the prefix cache, and the trainer's log-probs
of a multi-turn trajectory equal the engine's sampling log-probs, also where tool answers hold image placeholder
tokens (text after the prompt, for both)."""

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.rollout.agent.loop import AgentLoop, AgentSettings
from lathe.rollout.agent.parser import get_parser
from lathe.rollout.base import to_batch
from lathe.train.logprob import response_log_probs

from helpers import assert_close_rel
from models.vl_tiny import IMAGE, VISION_END, VISION_START, save_hf, text_and_image_prompts
from rollout.agent.test_loop import CALL, FakeTools

PAD = 0
BLOCK = 4
# a tool answer as the stub template renders it: text, a stray image placeholder run, text (all text to the model)
ANSWER = [5, 6, VISION_START, IMAGE, IMAGE, VISION_END, 7, 8]


class StubTokenizer:
    """What the loop asks of a tokenizer when the parser and renderer are given (it decodes turns for the parser)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return ""


class StubRenderer:
    """Every tool answer becomes `ANSWER`; turns need no closing tokens."""

    def stop_ids(self):
        return []

    def close_turn(self, turn_ids):
        return []

    def messages_delta(self, messages):
        return list(ANSWER)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_5"])
def vl_model(tmp_path_factory, request):
    """Qwen2.5-VL, and Qwen3.5 (hybrid layers: a finished turn keeps its linear-attention states for the next)."""
    from lathe.models.vl import load_lathe_vl_model
    path, _ = save_hf(tmp_path_factory.mktemp("vl"), request.param)
    return load_lathe_vl_model(path).eval()


def image_prompts(seed: int = 0):
    """(prompts, multi_modal_inputs): one image, two images, text only."""
    return text_and_image_prompts([[(1, 4, 4)], [(1, 4, 6), (1, 6, 4)], []], torch.Generator().manual_seed(seed),
                                  lambda g: 3)


def run_loop(model, prompts, inputs, **settings):
    """Trajectories whose every turn calls the calculator (the parser says so) and ends at one of a third of the
    vocabulary (turns of a few tokens); records each request's prompt length and prefix-cache hits, and how often the
    vision tower runs."""
    engine = LatheEngine(model, eos_token_id=None, block_size=BLOCK, num_kv_blocks=512, max_model_len=256)
    requests, encoded = {}, []
    add, pop, embed = engine.add_request, engine.pop_finished, model.embed_images

    def add_request(key, prompts, params, **kw):
        requests[key] = {"prompt": len(prompts[0]), "images": kw.get("multi_modal_inputs")}
        add(key, prompts, params, **kw)

    def pop_finished():
        done = pop()
        for key, out in done:
            requests[key]["hits"] = out.metrics["rollout/prefix_hit_tokens"]
        return done

    def embed_images(*args, **kw):
        encoded.append(1)
        return embed(*args, **kw)
    engine.add_request, engine.pop_finished = add_request, pop_finished
    model.embed_images = embed_images
    try:
        loop = AgentLoop(engine, StubTokenizer(), AgentSettings(**{"response_length": 48, **settings}),
                         tools=FakeTools(), parse=lambda text: get_parser("hermes")(CALL % "6*7"),
                         renderer=StubRenderer())
        out = loop.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=7,
                                                    stop_token_ids=list(range(3, VISION_START, 3))),
                            multi_modal_inputs=inputs)
    finally:
        del model.embed_images
    return out, requests, len(encoded)


def test_every_turn_carries_the_prompts_images_and_finds_the_last_in_the_prefix_cache(vl_model):
    """Every later turn carries the first prompt's prepared images and finds the previous turn in the cache: the
    prefix cache, or (Qwen3.5's hybrid layers) the previous turn parked with its states, keyed by tokens and images."""
    prompts, inputs = image_prompts()
    out, requests, encoded = run_loop(vl_model, prompts, inputs, max_assistant_turns=4)
    assert min(out.tool_calls) >= 1 and max(out.num_turns) >= 5, out.num_turns
    assert encoded == 2, "each image prompt's images are encoded once, for all its samples and turns"
    later = {k: r for k, r in requests.items() if k[2] > 0}
    assert len(later) >= 6
    for (prefix, index, turn), r in sorted(later.items()):
        images = r["images"]
        assert (images is None) == (inputs[index // 2] is None), (index, turn)
        if images is not None:
            assert images[0] is requests[(prefix, index, 0)]["images"][0]        # the same prepared images
        previous = requests[(prefix, index, turn - 1)]["prompt"]
        # the previous turn's prompt (the image prompt first) is found in the cache, to its last full block; a hybrid
        # model's (Qwen3.5) is its parked turn, its states and KV, which one conversation takes over: where the two
        # samples' turns ended with the same tokens taken in (a one-token turn), the sibling took it
        sibling = requests[(prefix, index ^ 1, turn)]
        assert r["hits"] >= previous // BLOCK * BLOCK or (
            vl_model.config.text.linear_attention is not None and r["hits"] == 0
            and sibling["hits"] >= requests[(prefix, index ^ 1, turn - 1)]["prompt"] // BLOCK * BLOCK
            and requests[(prefix, index ^ 1, turn - 1)]["prompt"] == previous), (index, turn, r, previous)
    assert out.metrics["agent/prefix_hit_rate"] > 0.6


def test_trainer_log_probs_equal_the_engines_over_a_multi_turn_image_trajectory(vl_model):
    """The batch `lathe train` builds of the loop's output (prompt rows repeated n times with their images, tool
    answers masked out of the loss): the trainer's log-probs of the model's tokens, packed and padded, equal what
    the engine sampled them with (fp32). The tool answers hold image placeholders: text in the response, for both."""
    prompts, inputs = image_prompts(1)
    out, _, _ = run_loop(vl_model, prompts, inputs, max_assistant_turns=3)
    assert sum(out.tool_calls) >= 6
    batch = to_batch(prompts, out, PAD, 2)
    batch.non_tensors["multi_modal_inputs"] = [m for m in inputs for _ in range(2)]
    mask = batch["response_mask"].bool()
    assert (batch["responses"][~mask & batch["attention_mask"][:, -mask.shape[1]:].bool()] == IMAGE).any()
    want = torch.tensor([x for row, m in zip(out.logprobs, out.loss_masks) for x, k in zip(row, m) if k])
    for packed in (True, False):
        logp, _ = response_log_probs(vl_model, batch, remove_padding=packed)
        assert_close_rel(logp[mask], want, name=f"trainer vs engine log-probs (packed={packed})", rel=1e-4)


def test_prepared_images_refuse_a_prompt_that_does_not_continue_theirs(vl_model):
    prompts, inputs = image_prompts()
    engine = LatheEngine(vl_model, eos_token_id=None, block_size=BLOCK, num_kv_blocks=64, max_model_len=256)
    images = engine.prepare_images(prompts[0], inputs[0])
    engine.add_request("ok", [prompts[0] + [5, IMAGE, 6]], SamplingParams(max_tokens=1), multi_modal_inputs=[images])
    with pytest.raises(ValueError, match="does not start with"):
        engine.add_request("other", [prompts[1]], SamplingParams(max_tokens=1), multi_modal_inputs=[images])
    while engine.has_unfinished_requests():
        engine.step()
    assert [k for k, _ in engine.pop_finished()] == ["ok"]
