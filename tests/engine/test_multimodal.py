"""Image prompts in the engine (Qwen2.5-VL / Qwen3-VL): greedy output equals transformers' `generate`, the n samples
of a prompt share its image's KV, other images never do, and chunked prefill cuts through an image correctly."""

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.models.vl import load_lathe_vl_model
from lathe.rollout.base import SamplingParams

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


def test_samples_share_an_image_prompt_and_other_images_do_not(pair):
    """The second sample of an image prompt finds its prompt in the prefix cache; the same tokens with other pixels
    find nothing (and generate what transformers generates for those pixels)."""
    hf, path = pair
    prompts, inputs = _prompts()
    engine = LatheEngine(load_lathe_vl_model(path), eos_token_id=None, block_size=4, num_kv_blocks=128)
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
