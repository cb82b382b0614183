"""Vision-language models on one GPU: the engine's rollout of image prompts, and `lathe train` GRPO steps.

    python bench/vl.py [--models qwen2.5-vl-7b,qwen3-vl-8b] [--phases engine,train] [--out bench/results/vl_<device>.json]
    python bench/vl.py --device cpu --models tiny --prompts 2 --n 2 --image 56 --text-len 8 --response-len 8 \
        --steps 2 --warmup 1 --lora-rank 0 --out /tmp/vl_smoke.json                                    # CPU smoke test

The workload, geo3k-like: random-weight Qwen2.5-VL-7B / Qwen3-VL-8B shapes (bf16), `--prompts` prompts of one
`--image`-pixel square image (random pixels, PNG in verl's `images` column) plus `--text-len` words of a
synthetic word-level tokenizer (the model's vocabulary size, the VL special tokens at its end), `--n` samples each,
exactly `--response-len` new tokens (`ignore_eos`), temperature 1.

- engine: lathe's engine on the model loaded in bf16, the prompts and images exactly as `lathe train` prepares them
  (`RLDataset` with the processor). Reported: tokens/s of whole `generate` calls (prefill and the vision tower
  included; each call starts with an empty prefix cache, as after a weight sync; the first call's time beside it),
  the same prompts without their images (image tokens replaced by text tokens: the cost of the images), the vision
  tower's seconds for all the images, and the decode roofline fraction (language-model weights plus each running
  sequence's KV, per step, over the HBM bandwidth).
- train: `lathe train` in a child process (LoRA of `--lora-rank` on every linear layer of the language model, the
  vision tower frozen: a 7B/8B model's full fine-tuning does not fit one 80 GB GPU with its rollout), per-step
  figures from the run's `metrics.jsonl`.
Writes JSON after each phase, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (REWARD_FILE, claim_workdir, default_workdir, device_name, git_sha, hbm_bandwidth, lathe_row,  # noqa: E402
                    roofline_tok_s, run_child, slug, sync, weight_bytes)

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]

VL_SHAPES = {
    # Qwen2.5-VL-7B-Instruct's config.json
    "qwen2.5-vl-7b": dict(
        family="qwen2_5_vl",
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=3584, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
        tie=False),
    # Qwen3-VL-8B-Instruct's config.json
    "qwen3-vl-8b": dict(
        family="qwen3_vl",
        text=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                      "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=4096, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
        tie=False),
    # a CPU smoke test
    "tiny": dict(
        family="qwen2_5_vl",
        text=dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, window_size=112,
                    fullatt_block_indexes=[1], tokens_per_second=2),
        tie=False),
}


# -- the workload on disk ----------------------------------------------------------------------------------
def special_ids(vocab_size: int) -> dict[str, int]:
    """The VL special tokens take the last ids of the vocabulary (below `vocab_size`)."""
    return {t: vocab_size - len(SPECIALS) + i for i, t in enumerate(SPECIALS)}


def write_processor(shape: str, where: Path, image: int) -> Path:
    """A word-level tokenizer of the model's vocabulary (id 0 `<eos>`/pad, 1 `<unk>`, words `w2..`, the VL special
    tokens last) with a Qwen-VL chat template, and the model family's slow image processor, in a directory of their
    own; the pixel bounds keep every image at `image`x`image`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lathe.data.multimodal import QWEN_VL_TEMPLATE
    s = VL_SHAPES[shape]
    v = s["text"]["vocab_size"]
    out = where / f"processor-{shape}-{image}"
    if (out / "tokenizer.json").exists():
        return out
    specials = special_ids(v)
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, v - len(SPECIALS))}, **specials}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>",
                                   additional_special_tokens=SPECIALS)
    fast.chat_template = QWEN_VL_TEMPLATE
    fast.save_pretrained(out)
    patch, merge = s["vision"]["patch_size"], s["vision"]["spatial_merge_size"]
    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=image * image,
                             max_pixels=image * image).save_pretrained(out)
    return out


def hf_config_dict(shape: str) -> dict:
    s = VL_SHAPES[shape]
    ids = special_ids(s["text"]["vocab_size"])
    text = {**s["text"], "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0}
    kw = dict(text_config=text, vision_config=s["vision"], tie_word_embeddings=s["tie"],
              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if s["family"] == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        d, arch = Qwen2_5_VLConfig(**kw).to_dict(), "Qwen2_5_VLForConditionalGeneration"
    else:
        from transformers import Qwen3VLConfig
        d, arch = Qwen3VLConfig(**kw).to_dict(), "Qwen3VLForConditionalGeneration"
    d["architectures"] = [arch]
    return d


def write_model(shape: str, where: Path, device: str) -> Path:
    """A random-weight checkpoint (bf16 safetensors + config.json), built on `device` and written once."""
    from lathe.models.vl import LatheVLForConditionalGeneration, VLConfig
    from lathe.models.vl.vision import rebuild_meta_buffers
    out = where / f"model-{shape}"
    if (out / "config.json").exists():
        return out
    cfg = VLConfig.from_hf_dict(hf_config_dict(shape), source=f"bench shape {shape}")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LatheVLForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(previous)
    rebuild_meta_buffers(model.model.visual, torch.device(device))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    del model            # the trainer runs in a child process: this one must not keep the GPU's memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def png(size: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_data(where: Path, shape: str, *, rows: int, image: int, text_len: int) -> Path:
    """verl's multimodal schema: a chat prompt with one `<image>` placeholder and the image's PNG bytes per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    vocab = VL_SHAPES[shape]["text"]["vocab_size"] - len(SPECIALS)
    g = torch.Generator().manual_seed(0)
    path = where / f"vl-{shape}-{image}-{text_len}.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "vl_bench", "prompt": [{"role": "user", "content": "<image>" + " ".join(
            f"w{int(i)}" for i in torch.randint(2, vocab, (text_len,), generator=g))}],
         "images": [{"bytes": png(image, i), "path": None}], "ability": "bench",
         "reward_model": {"style": "rule", "ground_truth": "0"}, "extra_info": {"index": i}}
        for i in range(rows)]), path)
    return path


# -- the engine --------------------------------------------------------------------------------------------
def bench_engine(shape: str, paths: dict, args) -> dict:
    from lathe.data.dataset import RLDataset
    from lathe.data.multimodal import load_processor
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models.vl import load_lathe_vl_model
    device = torch.device(args.device)
    processor = load_processor(str(paths["processor"]))
    ds = RLDataset(str(paths["parquet"]), processor.tokenizer, processor=processor, image_key="images",
                   max_prompt_length=args.max_prompt_length, split="train")
    items = [ds[i] for i in range(args.prompts)]
    prompts = [it["prompt_ids"] for it in items]
    mm = [it["multi_modal_inputs"] for it in items]
    model = load_lathe_vl_model(paths["model"], torch.bfloat16, device=device)
    image_id = model.config.image_token_id
    image_tokens = sum(t == image_id for t in prompts[0])
    res = {"prompt_tokens_mean": statistics.mean(map(len, prompts)), "image_tokens_per_prompt": image_tokens,
           "patches_per_image": int(mm[0]["image_grid_thw"].prod())}

    pixels = torch.cat([m["pixel_values"] for m in mm]).to(device, torch.bfloat16)
    grids = torch.cat([m["image_grid_thw"] for m in mm]).to(device)
    with torch.no_grad():
        model.embed_images(pixels, grids)                # warm-up
        sync(device)
        start = time.perf_counter()
        model.embed_images(pixels, grids)
        sync(device)
    res["vision_tower_s_all_images"] = time.perf_counter() - start

    engine = LatheEngine(model, eos_token_id=0, gpu_memory_utilization=args.gpu_memory_utilization,
                         max_num_seqs=args.max_num_seqs)
    params = SamplingParams(n=args.n, max_tokens=args.response_len, temperature=1.0, ignore_eos=True, seed=0)

    def timed(engine, p, m) -> tuple[float, dict]:
        engine.update_weights([])                        # an empty prefix cache, as after a weight sync
        sync(device)
        start = time.perf_counter()
        out = engine.generate(p, params, multi_modal_inputs=m)
        sync(device)
        seconds = time.perf_counter() - start
        assert all(len(t) == args.response_len for t in out.token_ids)
        return seconds, out.metrics

    tokens = args.prompts * args.n * args.response_len
    first, _ = timed(engine, prompts, mm)
    second, metrics = timed(engine, prompts, mm)
    text = [[t if t != image_id else 2 + (k % 1000) for k, t in enumerate(p)] for p in prompts]
    timed(engine, text, None)
    text_s, _ = timed(engine, text, None)
    bandwidth = hbm_bandwidth(device_name(device)) if device.type == "cuda" else None
    tcfg = model.config.text
    kv_shape = {"hidden_size": tcfg.head_dim * tcfg.num_attention_heads, "num_attention_heads": tcfg.num_attention_heads,
                "num_hidden_layers": tcfg.num_hidden_layers, "num_key_value_heads": tcfg.num_key_value_heads}
    lm_bytes = weight_bytes(model) - sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
    res.update({"tok_s": tokens / second, "first_call_tok_s": tokens / first, "call_s": second, "first_call_s": first,
                "text_only_tok_s": tokens / text_s, "text_only_call_s": text_s,
                "sequences": args.prompts * args.n, "new_tokens": tokens,
                "num_preemptions": metrics.get("rollout/num_preemptions"),
                "kv_cache_gb": metrics.get("rollout/kv_cache_gb"),
                "language_model_weight_gb": lm_bytes / 2**30})
    if bandwidth:
        lens = [len(p) for p in prompts for _ in range(args.n)]
        roof = roofline_tok_s(kv_shape, lm_bytes, lens, [args.response_len] * len(lens), bandwidth)
        res.update(roofline_tok_s=roof, roofline_fraction=res["tok_s"] / roof)
    del engine, model, pixels
    import gc
    gc.collect()                # the engine's graphs and runner refer to each other
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        res["left_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
    return res


# -- lathe train -------------------------------------------------------------------------------------------
def train_command(paths: dict, args) -> list[str]:
    seqs = args.prompts * args.n
    lora = ([f"actor_rollout_ref.model.lora_rank={args.lora_rank}", f"actor_rollout_ref.model.lora_alpha={2 * args.lora_rank}",
             "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.optim.lr=1e-5"]
            if args.lora_rank else ["actor_rollout_ref.actor.optim.lr=1e-6"])
    return [sys.executable, "-m", "lathe", "train", "base",
            f"data.train_files={paths['parquet']}", "data.val_files=null", "trainer.test_freq=-1",
            "data.image_key=images", f"data.train_batch_size={args.prompts}",
            f"data.max_prompt_length={args.max_prompt_length}", f"data.max_response_length={args.response_len}",
            "data.shuffle=false", f"actor_rollout_ref.model.path={paths['model']}",
            f"actor_rollout_ref.model.tokenizer_path={paths['processor']}", "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true", *lora,
            "actor_rollout_ref.actor.freeze_vision_tower=true",
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={args.n}",
            "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(args.micro, seqs)}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={min(2 * args.micro, seqs)}",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            f"reward.custom_reward_function.path={paths['reward']}",
            f"trainer.total_training_steps={args.steps}", "trainer.logger=[console]", "trainer.save_freq=-1",
            "trainer.resume_mode=disable", f"trainer.device={args.device}", "trainer.n_gpus_per_node=1",
            f"trainer.default_local_dir={paths['run']}", *args.extra]


def bench_train(shape: str, paths: dict, args) -> dict:
    cmd = train_command(paths, args)
    metrics = paths["run"] / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    rc, wall = run_child(cmd, Path(args.logs) / f"lathe-{shape}.log", args.timeout)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    row = {"command": " ".join(cmd[1:]), "returncode": rc, "wall_s": wall,
           **(lathe_row(steps, args.warmup, 0.0, None) if steps else {})}
    if rc and not steps:
        row["log_tail"] = (Path(args.logs) / f"lathe-{shape}.log").read_text()[-3000:]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2.5-vl-7b,qwen3-vl-8b")
    p.add_argument("--phases", default="train,engine", help="train first: its child process needs the whole GPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--image", type=int, default=448, help="square images of this many pixels a side")
    p.add_argument("--text-len", type=int, default=64, help="words of text per prompt besides the image")
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--max-prompt-length", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro", type=int, default=8, help="sequences per forward/backward in the update")
    p.add_argument("--lora-rank", type=int, default=64, help="0: full fine-tuning")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=default_workdir("lathe-vl"))
    p.add_argument("--logs", default=None)
    p.add_argument("--git-sha", default=None, help="the commit measured, as your checkout names it")
    p.add_argument("--extra", nargs="*", default=[], metavar="key=value")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    where = claim_workdir(Path(args.workdir))
    where.mkdir(parents=True, exist_ok=True)
    args.logs = args.logs or str(where / "logs")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    name = device_name(torch.device(args.device))
    out = Path(args.out or ROOT / "bench" / "results" / f"vl_{slug(name)}.json")
    results = {"bench": "vl", "device": name,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "args": vars(args), "models": {}}
    (where / "reward.py").write_text(REWARD_FILE)
    for shape in args.models.split(","):
        res = results["models"].setdefault(shape, {})
        paths = {"processor": write_processor(shape, where, args.image), "model": write_model(shape, where, args.device),
                 "parquet": write_data(where, shape, rows=args.prompts * (args.steps + 1), image=args.image,
                                       text_len=args.text_len),
                 "reward": where / "reward.py", "run": where / f"run-{shape}"}
        for phase in args.phases.split(","):
            try:
                res[phase] = bench_engine(shape, paths, args) if phase == "engine" else bench_train(shape, paths, args)
            except Exception as e:                      # keep the other phases' figures
                import traceback
                res[phase] = {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2, default=str))
            print(json.dumps({shape: {phase: {k: v for k, v in res[phase].items() if k not in ("command", "traceback")}}},
                             indent=1, default=str), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
