"""`lathe model check MODEL_DIR`: does lathe's decoder reproduce transformers on this checkpoint?

Loads the checkpoint twice, with lathe and with transformers, in float32, runs both on a few ragged,
left-padded random batches, and reports the largest logit difference over real tokens, for lathe's
padded forward and for its packed forward (the one training uses). Exit status 0 means lathe will use
its own decoder and agrees within `atol`, or that lathe does not implement the architecture and will
use transformers; 1 means lathe disagrees with transformers, or could not load the checkpoint.

MODEL_DIR may be a lathe checkpoint (`global_step_<k>`: its actor's `huggingface/` is checked) or a directory
inside one; the checkpoint's files are verified against its manifest first (`lathe.ckpt.manifest`), and a
damaged checkpoint exits 1 before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from lathe.ckpt import manifest
from lathe.device import default_device_type
from lathe.models import LatheConfig, UnsupportedArchitecture, load_lathe_model
from lathe.models.packing import pack_padded, position_ids_from_mask, unpack_to_padded


def ragged_batch(gen: torch.Generator, vocab_size: int, *, batch_size: int = 4, min_len: int = 3,
                 max_len: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) of random rows of random lengths, left-padded."""
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    L = int(lengths.max())
    input_ids = torch.randint(0, vocab_size, (batch_size, L), generator=gen)
    attention_mask = (torch.arange(L) >= (L - lengths).unsqueeze(1)).long()
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


@torch.no_grad()
def compare_logits(lathe_model, hf_model, batches, device) -> dict[str, float]:
    """Largest |logit difference| over real tokens: lathe padded vs transformers, lathe packed vs transformers."""
    worst = {"padded": 0.0, "packed": 0.0}
    for input_ids, mask, pos in batches:
        input_ids, mask, pos = input_ids.to(device), mask.to(device), pos.to(device)
        ref = hf_model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
        real = mask.bool()
        padded = lathe_model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits.float()
        packed_batch = pack_padded(input_ids, mask, pos)
        packed = lathe_model.forward_packed(packed_batch.input_ids, packed_batch.position_ids,
                                            packed_batch.cu_seqlens, packed_batch.max_seqlen, return_hidden=False)
        packed = unpack_to_padded(packed.float(), packed_batch)
        worst["padded"] = max(worst["padded"], (padded - ref)[real].abs().max().item())
        worst["packed"] = max(worst["packed"], (packed - ref)[real].abs().max().item())
    return worst


def _fallback(model_dir: str, out: Callable[[str], None]) -> int:
    """lathe's decoder cannot read the checkpoint: 0 when transformers loads every tensor of it (the fallback then
    trains it), 1 with the tensors named when it would initialise some at random (a broken checkpoint)."""
    from lathe.models.hf import ModelLoadError, load_causal_lm
    try:
        load_causal_lm(model_dir)
    except ModelLoadError as e:
        out(f"BROKEN CHECKPOINT: {e}")
        out("lathe will use: nothing (lathe train refuses this checkpoint)")
        return 1
    out("lathe will use: transformers fallback (it loads every tensor of the checkpoint)")
    return 0


def enclosing_checkpoint(model_dir: Path) -> tuple[Path, Path | None]:
    """(the Hugging Face directory to check, the lathe checkpoint holding it or None)."""
    if not model_dir.is_dir():
        return model_dir, None                     # a hub id
    for ckpt in (model_dir, *list(model_dir.resolve().parents)[:2]):   # global_step_<k>[/actor[/huggingface]]
        if (ckpt / "trainer_state.pt").exists() or (ckpt / manifest.MANIFEST).exists():
            return (model_dir / "actor" / "huggingface" if ckpt == model_dir else model_dir), ckpt
    return model_dir, None


def verify_checkpoint(ckpt: Path, out: Callable[[str], None]) -> bool:
    """`manifest.check` for `lathe model check`: False (after the report) when the checkpoint is damaged."""
    def fix(good: Path | None) -> str:
        return (f"check that one (lathe model check {good}), or restore the file from a copy." if good is not None
                else "restore the file from a copy.")
    try:
        if manifest.check(ckpt, fix=fix, warn=lambda message: out(f"WARNING: {message}")):
            out(f"files: every file of {ckpt} matches its {manifest.MANIFEST}")
    except manifest.CheckpointDamaged as e:
        out(f"DAMAGED CHECKPOINT: {e}")
        out("lathe will use: nothing (resume and lathe export refuse this checkpoint)")
        return False
    return True


def run_check(model_dir: str | Path, *, num_batches: int = 3, seed: int = 0, atol: float = 1e-4,
              out: Callable[[str], None] = print) -> int:
    """Compare lathe's decoder with transformers on `model_dir`; print a report; return the exit status."""
    hf_dir, ckpt = enclosing_checkpoint(Path(model_dir).expanduser())
    if ckpt is not None and not verify_checkpoint(ckpt, out):
        return 1
    model_dir = str(hf_dir) if ckpt is not None else str(model_dir)
    try:
        cfg = LatheConfig.from_pretrained(model_dir)
    except UnsupportedArchitecture as e:
        out(f"{e}")
        return _fallback(model_dir, out)
    device = torch.device(default_device_type())
    out(f"checkpoint: {model_dir}")
    out(f"architecture: {cfg.architecture} (layers={cfg.num_hidden_layers}, hidden={cfg.hidden_size}, "
        f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, rope={cfg.rope.rope_type}, "
        f"tied embeddings={cfg.tie_word_embeddings})")
    try:
        lathe_model = load_lathe_model(model_dir, torch.float32, device=device).eval()
    except UnsupportedArchitecture as e:
        out(f"{e}")
        return _fallback(model_dir, out)
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                    local_files_only=Path(model_dir).is_dir()).to(device).eval()
    gen = torch.Generator().manual_seed(seed)
    batches = [ragged_batch(gen, cfg.vocab_size) for _ in range(num_batches)]
    worst = compare_logits(lathe_model, hf_model, batches, device)
    out(f"device: {device.type}, float32, {num_batches} ragged left-padded batches, seed {seed}")
    out(f"max |logit diff| vs transformers: padded {worst['padded']:.3e}, packed {worst['packed']:.3e} "
        f"(tolerance {atol:.0e}, packed attention backend: {lathe_model.packed_backend()})")
    if max(worst.values()) > atol:
        out("MISMATCH: lathe's decoder disagrees with transformers on this checkpoint beyond the tolerance. "
            "Please report it with this output; until then lathe should not run this checkpoint with its "
            "own decoder.")
        out("lathe will use: lathe decoder (DISAGREES)")
        return 1
    out("lathe will use: lathe decoder (agrees with transformers)")
    return 0
