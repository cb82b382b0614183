"""Image prompts in the engine (Qwen2.5-VL / Qwen3-VL): greedy output equals transformers' `generate`, the n samples
of a prompt share its image's KV, other images never do, and chunked prefill cuts through an image correctly."""

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models.vl import load_lathe_vl_model

from helpers import assert_close_rel

from models.vl_tiny import FAMILIES, IMAGE, image_tokens, ragged_vl_batch, save_hf

MAX = 6


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    path, hf = save_hf(tmp_path_factory.mktemp("vl-engine"), request.param)
    return hf, path


def _prompts(seed: int = 0):
    """The ragged batch's rows unpadded, with each row's own images: (prompts, multi_modal_inputs)."""
    ids, mask, pixels, grid, _ = ragged_vl_batch(seed)
    prompts, inputs, img, patch = [], [], 0, 0
    for b in range(ids.shape[0]):
        row = ids[b][mask[b].bool()]
        count, taken = 0, 0
        while taken < int((row == IMAGE).sum()):
            taken += image_tokens(grid[img + count])
            count += 1
        patches = int(grid[img:img + count].prod(-1).sum())
        prompts.append(row.tolist())
        inputs.append({"pixel_values": pixels[patch:patch + patches], "image_grid_thw": grid[img:img + count]}
                      if count else None)
        img, patch = img + count, patch + patches
    return prompts, inputs


def _hf_greedy(hf, prompt, inputs):
    ids = torch.tensor([prompt])
    kw = {} if inputs is None else dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                                        mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX,
                          min_new_tokens=MAX, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [512, 7])
def test_engine_greedy_equals_transformers_generate_on_image_prompts(pair, budget):
    """n=2 greedy samples per prompt (text rows, one image, two images); budget 7 chunks each prompt's prefill
    through its images."""
    hf, path = pair
    prompts, inputs = _prompts()
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128,
                         max_num_batched_tokens=budget)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=MAX), multi_modal_inputs=inputs)
    for i, (prompt, mm) in enumerate(zip(prompts, inputs)):
        assert out.token_ids[2 * i] == out.token_ids[2 * i + 1] == _hf_greedy(hf, prompt, mm), f"prompt {i}"


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "forked"])
def test_samples_share_an_image_prompt_and_other_images_do_not(pair, prefix_caching):
    """The second sample of an image prompt finds its prompt in the prefix cache; the same tokens with other pixels
    find nothing (and generate what transformers generates for those pixels). Without prefix caching (always so
    for Qwen3.5's hybrid layers) the n samples fork from the first once its prompt, images and all, is computed."""
    hf, path = pair
    prompts, inputs = _prompts()
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128,
                         enable_prefix_caching=prefix_caching)
    if not engine.block_manager.enable_prefix_caching:
        params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=5)
        seqs = engine._make_sequences([prompts[1]], params, 0, [inputs[1]])
        for seq in seqs:
            engine.scheduler.add(seq)
        while not engine.scheduler.is_finished():
            engine.step()
        assert [s.num_prefix_hit_tokens for s in seqs] == [0] + [len(prompts[1]) - 1] * 2     # forked, not prefilled
        alone = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128,
                            enable_prefix_caching=False)
        for j, seq in enumerate(seqs):       # each sample's tokens as it draws them prefilling on its own
            one = alone._make_sequences([prompts[1]], params, 0, [inputs[1]])[j]
            one.leader = None
            alone.scheduler.add(one)
            while not alone.scheduler.is_finished():
                alone.step()
            assert one.output_token_ids == seq.output_token_ids, f"sample {j}"
        return
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    engine.generate([prompts[1]], params, multi_modal_inputs=[inputs[1]])
    other = {**inputs[1], "pixel_values": inputs[1]["pixel_values"] + 1.0}
    seqs = engine._make_sequences([prompts[1]], params, 0, [other])
    engine.scheduler.add(seqs[0])
    engine.step()
    assert seqs[0].num_prefix_hit_tokens == 0                  # other pixels: nothing reused
    while not engine.scheduler.is_finished():
        engine.step()
    same = engine._make_sequences([prompts[1]], params, 0, [inputs[1]])
    engine.scheduler.add(same[0])
    engine.step()
    assert same[0].num_prefix_hit_tokens == len(prompts[1]) - 1
    while not engine.scheduler.is_finished():
        engine.step()
    assert seqs[0].output_token_ids == _hf_greedy(hf, prompts[1], other)


def test_text_engine_refuses_images_and_bad_inputs_are_named(pair, checkpoints):
    hf, path = pair
    prompts, inputs = _prompts()
    text = LatheEngine.from_pretrained(checkpoints["qwen2"][0], eos_token_id=None, block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="prompt 1 carries images"):
        text.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), multi_modal_inputs=[None, inputs[1]])
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(prompts, SamplingParams(max_tokens=2), multi_modal_inputs=inputs[:2])
    two_images = inputs[2]
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([prompts[1]], SamplingParams(max_tokens=2), multi_modal_inputs=[two_images])


def test_graph_decode_step_of_image_prompts_on_cpu(pair, triton_interpreter, monkeypatch):
    """The CUDA-graph step's own work run eagerly on the CPU (as `test_cuda_graph` does for text): generated tokens
    of image prompts sit at index + rope delta there too, so seeded samples equal the plain engine's."""
    import lathe.engine.llm_engine as llm
    from lathe.engine.cuda_graph import DecodeGraphs
    from lathe.engine.sampler import fused_settings
    from .test_cuda_graph import _Replay

    _, path = pair
    prompts, inputs = _prompts()
    monkeypatch.setattr("lathe.device.multiprocessor_count", lambda device: 4)
    monkeypatch.setattr(llm, "fused_settings", lambda device, vocab, seqs: fused_settings(
        torch.device("cuda"), vocab, seqs))
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, b: self.graphs.__setitem__(b, _Replay(self, b)))
    params = SamplingParams(n=2, temperature=0.8, max_tokens=MAX, seed=1)
    outs = []
    for graphs in (False, True):
        engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128,
                             async_scheduling=graphs)
        if graphs:
            engine.runner.graphs = DecodeGraphs(engine.runner, 8)
        outs.append(engine.generate(prompts, params, multi_modal_inputs=inputs))
    assert outs[1].token_ids == outs[0].token_ids


def _run_requests(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        engine.step()
        done.update(engine.pop_finished())
    return done


def test_streamed_image_requests_equal_generate(pair):
    """`add_request(..., multi_modal_inputs=)` (fully-async rollout) samples what `generate` samples for the same
    prompts and images: greedy token for token, and seeded sampling beside it, whatever shares the batch."""
    _, path = pair
    prompts, inputs = _prompts()
    greedy = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=5)
    ref = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    engine.add_request("all", prompts, greedy, multi_modal_inputs=inputs)
    engine.step()
    engine.add_request("two-images", [prompts[2]], sampled, first_index=6, multi_modal_inputs=[inputs[2]])
    done = _run_requests(engine)
    assert done["all"].token_ids == ref.generate(prompts, greedy, multi_modal_inputs=inputs).token_ids
    want = ref.generate([prompts[2]], sampled, first_index=6, multi_modal_inputs=[inputs[2]])
    assert done["two-images"].token_ids == want.token_ids
    with pytest.raises(ValueError, match="add_request 'bad': .*one per prompt"):
        engine.add_request("bad", prompts, greedy, multi_modal_inputs=inputs[:1])


def _other_tower(model, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """The vision tower's tensors of `model`, each moved by random noise of its own scale (new vision weights)."""
    gen = torch.Generator().manual_seed(seed)
    return [(k, v + 0.5 * v.float().std().nan_to_num() * torch.randn(v.shape, generator=gen))
            for k, v in model.state_dict().items() if k.startswith("model.visual.") and v.is_floating_point()]


def _continued(engine, prompt, images, prefix, max_tokens):
    """Greedy tokens and log-probs after `prefix`: a sample of `prompt` that generated `prefix` already (text tokens,
    whatever their ids), computed from scratch by `engine` (one prefill of prompt + prefix, then decodes)."""
    [seq] = engine._make_sequences([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), 0, [images])
    for token in prefix:
        seq.append_token(token, 0.0)
    engine.scheduler.add(seq)
    while not engine.scheduler.is_finished():
        engine.step()
    return seq.output_token_ids[len(prefix):], seq.logprobs[len(prefix):]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_interrupted_image_prompt_continues_on_the_new_vision_tower(pair, async_scheduling):
    """Partial rollout with images: responses interrupted at a weight sync that changes only the vision tower are
    re-prefilled with their images encoded by the new tower (the old tower's embeddings are dropped), so each
    continues as a sample of the same tokens so far does under the new weights; a request that was queued (encoded
    by the old tower) when the weights came generates what the new weights generate from scratch."""
    _, path = pair
    prompts, inputs = _prompts()
    prompt, images, max_tokens = prompts[2], inputs[2], 10
    new_tower = _other_tower(load_lathe_vl_model(path))

    def engine(tower=(), **kw):
        model = load_lathe_vl_model(path)
        if tower:
            model.load_state_dict(dict(tower), strict=False)
        return LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=128, **kw)

    params = SamplingParams(n=2, temperature=0, max_tokens=max_tokens)
    live = engine(async_scheduling=async_scheduling)
    live.add_request("r", [prompt], params, multi_modal_inputs=[images])
    for _ in range(4):
        live.step()
    assert live.interrupt() == 2
    live.add_request("queued", [prompt], params, multi_modal_inputs=[images])     # waits through the sync
    live.load_weights(new_tower[:3], version=1)             # in buckets, as a sync loads them
    live.load_weights(new_tower[3:], version=1)
    assert not live.block_manager.hash_to_block
    done = _run_requests(live)
    old, new = engine(), engine(new_tower)
    changed = False
    for tokens, logprobs, spans in zip(done["r"].token_ids, done["r"].logprobs, done["r"].versions):
        assert len(spans) == 2 and spans[0] == (0, 0) and spans[1][0] == 1
        switch = spans[1][1]
        assert 0 < switch < max_tokens
        want, want_logprobs = _continued(new, prompt, images, tokens[:switch], max_tokens)
        assert tokens[switch:] == want, "the continuation did not use the new vision tower"
        assert_close_rel(logprobs[switch:], want_logprobs, rel=1e-4, name="continued log-probs")
        changed |= want != _continued(old, prompt, images, tokens[:switch], max_tokens)[0]
    assert changed, "precondition: the new vision tower changes the continuation"
    assert done["queued"].token_ids == new.generate([prompt], params, multi_modal_inputs=[images]).token_ids


# ---- tensor-parallel engine replicas of a VL model (`lathe.engine.tensor_parallel`, module-level for the forkserver)

def build_vl(path: str, tp, device=torch.device("cpu")):
    """lathe's VL model of `path`, whole (`tp` None) or this rank's slice of a replica (its experts over the replica,
    its vision tower whole)."""
    from lathe.engine.tensor_parallel import shard_copy
    model = load_lathe_vl_model(path)
    if tp is None:
        return model
    moe = model.config.text.moe is not None
    return shard_copy(model, torch.float32, device, tp, expert_parallel_size=tp.size if moe else 1)


def vl_generations(model, path: str) -> list:
    """Greedy and sampled on text and image prompts, and greedy again after new weights (each scaled, the vision
    tower's too): what a trainer's update sends, by name."""
    prompts, inputs = _prompts()
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=128, max_model_len=64)
    out = [engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=MAX),
                           multi_modal_inputs=inputs).token_ids,
           engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=MAX, seed=3),
                           multi_modal_inputs=inputs).token_ids]
    whole = load_lathe_vl_model(path)
    engine.update_weights((name, t * 1.05 if t.dim() == 2 else t) for name, t in whole.state_dict().items())
    out.append(engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=MAX),
                               multi_modal_inputs=inputs).token_ids)
    return out


def test_a_tensor_parallel_replica_of_a_vl_model_generates_what_one_process_generates(tmp_path):
    """Qwen2.5-VL, Qwen3.5-MoE (hybrid layers, routed and shared experts), Qwen3-VL-MoE (deepstack, experts),
    GLM-4.1V (its q/k rows permuted, norms on each output) and GLM-4.5V (GLM-4.5's MoE layers) over 2 gloo ranks:
    each rank its language model's slice (heads, MLP columns, linear-attention heads, experts) and the whole vision
    tower, which each runs on the prompt's images; greedy and sampled on text and image prompts, and after new
    weights: token for token what one process generates."""
    from engine.test_tensor_parallel import run_replica
    families = ("qwen2_5_vl", "qwen3_5_moe", "qwen3_vl_moe", "glm4v", "glm4v_moe")
    paths = [str(save_hf(tmp_path, family)[0]) for family in families]
    want = [vl_generations(build_vl(p, None), p) for p in paths]
    for rank, got in run_replica(2, paths, make=build_vl, generate=vl_generations).items():
        for family, g, w in zip(families, got, want):
            for what, a, b in zip(("greedy", "sampled", "greedy after new weights"), g, w):
                assert a == b, f"rank {rank} of 2, {family}: {what} tokens differ"


def test_a_hybrid_vl_models_parked_turn_is_continued_only_with_its_own_images(tmp_path):
    """Qwen3.5 (no prefix cache: hybrid layers) parks a finished streamed turn with its KV and linear-attention states
    for the prompt that continues it (the agent loop's next turn). An image prompt's turn is keyed by its tokens and
    its images: the same tokens with other pixels compute everything again; with its own prepared images the
    continuation takes the parked turn over and generates what a fresh engine does for the whole conversation."""
    path, _ = save_hf(tmp_path, "qwen3_5")
    prompts, inputs = _prompts()
    params = SamplingParams(n=1, temperature=0, max_tokens=3)

    def turn(engine, key, prompt, mm):
        engine.add_request(key, [prompt], params, multi_modal_inputs=[mm])
        while engine.has_unfinished_requests():
            engine.step()
        (_, out), = engine.pop_finished()
        return out

    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    first = turn(engine, "a", prompts[1], inputs[1])
    prepared = engine.prepare_images(prompts[1], inputs[1])
    conversation = prompts[1] + first.token_ids[0] + [5, 9]            # its answer, then a tool's (text)
    other = {**inputs[1], "pixel_values": inputs[1]["pixel_values"] + 1.0}
    assert turn(engine, "b", conversation, other).metrics["rollout/prefix_hit_tokens"] == 0
    turn(engine, "c", prompts[1], inputs[1])                              # parked again
    again = turn(engine, "d", conversation, prepared)
    assert again.metrics["rollout/prefix_hit_tokens"] >= len(prompts[1])
    fresh = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    assert again.token_ids == turn(fresh, "e", conversation, inputs[1]).token_ids


def test_prepared_images_held_across_a_weight_load_are_encoded_again_by_the_new_tower(pair):
    """An agent's trajectory holds its prompt's prepared images between turns; a weight load (a fully-async sync
    while a tool runs) drops their embeddings wherever they are held, so the next turn encodes them with the new
    vision tower and generates what an engine that had the new weights from the start generates."""
    _, path = pair
    prompts, inputs = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=MAX)
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    prepared = engine.prepare_images(prompts[1], inputs[1])
    first = engine.generate([prompts[1]], greedy, multi_modal_inputs=[prepared]).token_ids[0]
    old = prepared.embeds.clone()
    tower = _other_tower(engine.model)
    engine.load_weights(tower, version=1)
    assert prepared.embeds is None
    conversation = prompts[1] + first + [5, 9]                          # its answer, then a tool's (text)
    got = engine.generate([conversation], greedy, multi_modal_inputs=[prepared]).token_ids
    assert not torch.equal(prepared.embeds, old)                        # precondition: the new tower differs
    fresh = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
    fresh.load_weights(tower, version=1)
    assert got == fresh.generate([conversation], greedy, multi_modal_inputs=[inputs[1]]).token_ids
