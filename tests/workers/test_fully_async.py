"""lathe.workers.fully_async in one process (no Ray): a rollout replica streams requests through its engine thread,
stops on the checkpoint's end-of-sequence ids, hands finished requests out while others run, pauses (interrupting
or finishing what runs) and continues; per-token weight versions from the engine's spans. A replica of a
vision-language model takes image requests and image validation batches."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lathe.batch import Batch
from lathe.rollout.base import token_versions
from lathe.workers.fully_async import RolloutWorker
from lathe.config import load_config
from lathe.generation import SamplingParams
from lathe.loop.setup import _given_model
from lathe.models.hf import load_policy, load_tokenizer

WAIT_S = 60


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """A replica of the built-in tiny model, saved with a generation_config naming two more end-of-sequence ids."""
    cfg = load_config("default", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                  "actor_rollout_ref.rollout.max_num_seqs=1", "data.max_response_length=256"])
    tokenizer = load_tokenizer("builtin:tiny")
    path, kwargs = _given_model(cfg, tokenizer)
    model_dir = tmp_path_factory.mktemp("model")
    load_policy(path, **kwargs).save_pretrained(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    worker = RolloutWorker(cfg, str(model_dir), {"impl": "auto"}, tokenizer, device_type="cpu")
    yield worker, tokenizer
    worker.shutdown()


def test_a_replica_stops_on_the_checkpoints_end_of_sequence_ids(replica):
    worker, tokenizer = replica
    assert {tokenizer.eos_token_id, 5, 7} <= set(worker.engine.eos_ids)


def _collect_until(worker, ids: set, timeout_s: float = WAIT_S) -> dict:
    got, deadline = {}, time.monotonic() + timeout_s
    while not ids <= set(got) and time.monotonic() < deadline:
        got.update(worker.collect(wait_s=0.5)["done"])
    assert ids <= set(got), f"requests {sorted(ids - set(got))} not finished within {timeout_s} s"
    return got


def test_finished_requests_come_out_while_a_long_one_runs_and_a_pause_interrupts_it(replica):
    worker, _ = replica
    long = SamplingParams(n=2, temperature=1.0, max_tokens=256, ignore_eos=True, seed=1)
    short = SamplingParams(temperature=0, max_tokens=1)
    worker.submit([("short", [[6, 7]], short, 0), ("long", [[3, 4, 5]], long, 0)])
    got = _collect_until(worker, {"short"})          # one sequence at a time: short ends 512 steps before long
    assert "long" not in got and got["short"]["responses"].shape == (1, 1)
    assert worker.pause(partial=True, timeout_s=WAIT_S) >= 1          # long was mid-way: interrupted
    worker.resume()
    out = _collect_until(worker, {"long"})["long"]
    assert out["response_mask"].sum(-1).tolist() == [256, 256]
    assert (out["rollout_versions"] == 0).all()      # no new weights came: one version throughout
    # without partial rollout a pause lets what runs finish first
    worker.submit([("again", [[3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 0)])
    assert worker.pause(partial=False, timeout_s=WAIT_S) == 0
    assert "again" in worker.collect()["done"][0]
    worker.resume()


def test_token_versions_follow_the_spans():
    spans = [[(0, 0), (1, 3)], [(2, 0)], [(1, 0), (2, 1), (3, 2)]]
    assert token_versions(spans, 5).tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, 2], [1, 2, 3, 3, 3]]
    assert token_versions([], 3).shape == (0, 3) and token_versions(spans, 5).dtype == torch.long


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_a_replica_of_a_vl_model_generates_from_each_prompts_images(tmp_path, family):
    """Requests carry their prompts' images (`multi_modal_inputs`, one entry per prompt, None for text), streamed
    and in the blocking validation call alike: the replica samples what the engine's `generate` samples for them
    (Qwen3.5: hybrid layers, whose n samples of a prompt fork from the first)."""
    from types import SimpleNamespace

    from lathe.engine.llm_engine import LatheEngine
    from lathe.models.vl import load_lathe_vl_model
    from engine.test_multimodal import _prompts
    from models.vl_tiny import save_hf

    path, _ = save_hf(tmp_path, family)
    cfg = load_config("default", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                  "data.max_response_length=6", "data.train_batch_size=0"])
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)     # (the replica reads these two ids only)
    worker = RolloutWorker(cfg, str(path), {"impl": "auto"}, tokenizer, device_type="cpu")
    try:
        assert worker.engine.vl
        prompts, inputs = _prompts()
        params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
        want = LatheEngine(load_lathe_vl_model(path), eos_token_id=[2], block_size=4, num_kv_blocks=128).generate(
            prompts, params, first_index=4, multi_modal_inputs=inputs)
        worker.submit([("images", prompts, params, 4, inputs)])
        got = _collect_until(worker, {"images"})["images"]
        validation = worker.generate_sequences(Batch(non_tensors={"prompt_ids": prompts,
                                                                  "multi_modal_inputs": inputs}),
                                               params, first_index=4)
        for batch in (got, validation):
            responses = [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]
            assert responses == want.token_ids
        assert validation["multi_modal_inputs"][2] is inputs[1], "the rows keep their own images (n=2 each)"
    finally:
        worker.shutdown()


def test_a_vl_trajectory_waiting_for_its_tool_across_a_sync_takes_the_new_vision_tower(tmp_path, monkeypatch):
    """Multi-turn on a replica of a VL model: turn 0 runs on the prompt's image; its tool call is held while the
    replica pauses and loads new vision-tower weights; then it answers, and turn 1's prefill encodes the image again:
    every prefill's image embeddings are the vision tower's of that moment."""
    import threading

    from PIL import Image

    from engine.test_multimodal import _other_tower
    from lathe.data.multimodal import encode_multimodal_prompt, tiny_vl_processor
    from lathe.engine import llm_engine
    from lathe.rollout.agent import builtin_tools
    from lathe.workers.fully_async import request_agent
    from loop.test_vl_agent import TOOLS, force_calls
    from loop.test_vl_train import _checkpoint

    model_dir, tokenizer_dir = _checkpoint(tmp_path)
    (tmp_path / "tools.yaml").write_text(TOOLS)
    force_calls(monkeypatch)
    started, release = threading.Event(), threading.Event()
    execute = builtin_tools.CalculatorTool.execute

    def held(self, *args, **kwargs):
        started.set()
        assert release.wait(WAIT_S)
        return execute(self, *args, **kwargs)
    monkeypatch.setattr(builtin_tools.CalculatorTool, "execute", held)
    encoded = []                                    # at each prefill of an image prompt: its embeddings are current
    ensure = llm_engine.ensure_embeddings

    def checked(model, mm):
        ensure(model, mm)
        with torch.inference_mode():
            now = model.embed_images(mm.pixel_values, mm.grid).embeds
        encoded.append(torch.equal(mm.embeds, now))
    monkeypatch.setattr(llm_engine, "ensure_embeddings", checked)
    cfg = load_config("default", ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
                                  "data.train_batch_size=0", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                  "data.max_response_length=96", "data.max_prompt_length=64",
                                  f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
                                  "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"])
    tokenizer = load_tokenizer(str(tokenizer_dir))
    messages = [{"role": "user", "content": "<image>which?"}]
    ids, images, _ = encode_multimodal_prompt(messages, [Image.new("RGB", (16, 16), (200, 30, 30))],
                                              tiny_vl_processor(), "row 0")
    prompts = Batch(non_tensors={"prompt_ids": [ids], "extra_info": [{}], "raw_prompt": [messages]})
    worker = RolloutWorker(cfg, str(model_dir), {"impl": "auto"}, tokenizer, device_type="cpu")
    try:
        params = SamplingParams(n=1, temperature=1.0, max_tokens=96, seed=5)
        worker.submit([("r", prompts["prompt_ids"], params, 0, [images], request_agent(prompts))])
        assert started.wait(WAIT_S), "turn 0 ran and called the tool"
        assert worker.pause(partial=True, timeout_s=WAIT_S) == 0         # no turn in progress: the tool waits
        worker.engine.load_weights(_other_tower(worker.engine.model), version=1)
        release.set()
        worker.resume()
        out = _collect_until(worker, {"r"})["r"]
    finally:
        release.set()
        worker.shutdown()
    assert out["num_turns"] == [4] and out["tool_calls"] == [1]          # prompt, turn 0, the answer, turn 1
    assert len(encoded) >= 2 and all(encoded), encoded                  # turn 1 took the new tower's embeddings
