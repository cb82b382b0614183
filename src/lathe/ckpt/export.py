"""`lathe export`: a run's checkpoint as a plain Hugging Face directory (verl's `model_merger merge`).

    lathe export RUN_DIR OUT_DIR                 # the latest checkpoint's actor
    lathe export RUN_DIR OUT_DIR --step 20 --part critic
    lathe export RUN_DIR/global_step_20 OUT_DIR --check    # then load it with transformers and run a forward

Every checkpoint already holds its part's full weights as a Hugging Face directory (`<part>/huggingface`: config,
safetensors, tokenizer, generation config), written by rank 0 also when the ranks saved sharded state, so nothing
needs merging: the export copies that directory, after checking that it is complete (every tensor its safetensors
index names is in its files), and `--check` loads it with transformers. A LoRA run's checkpoint holds the merged
model there (base + adapters, written at save time) beside the adapter itself in PEFT's layout (`lora_adapter/`),
so its export is the merged model too. The checkpoint is verified against its manifest first (`lathe.ckpt.manifest`):
a damaged one (any file of it missing, truncated or changed) is refused, naming the last one of the run that
verifies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lathe.ckpt import manifest
from lathe.ckpt.checkpoint import LATEST, _step_dirs, _step_of, step_dir

PARTS = ("actor", "critic")


def find_checkpoint(source: str | Path, step: int | None = None) -> Path:
    """`global_step_<k>` from a run directory (its latest, or `step`) or from such a directory itself."""
    path = Path(source).expanduser()
    if (path / "trainer_state.pt").exists() and step is None:
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"lathe export: {path} does not exist. Fix: give a run directory "
                                "(trainer.default_local_dir) or one of its global_step_<k> directories.")
    steps = sorted(_step_of(d) for d in _step_dirs(path))
    if step is None:
        if not (path / LATEST).exists():
            raise FileNotFoundError(f"lathe export: {path} holds no {LATEST} (checkpoints: "
                                    f"{steps or 'none'}). Fix: point at a run directory that saved checkpoints "
                                    "(trainer.save_freq), or pass --step.")
        step = int((path / LATEST).read_text().strip())
    if step not in steps:
        raise FileNotFoundError(f"lathe export: {path} has no global_step_{step} (it has {steps or 'none'}). "
                                "Fix: pass one of those with --step.")
    return step_dir(path, step)


def check_complete(hf_dir: Path) -> list[str]:
    """The weight files a Hugging Face directory needs; raises naming what is missing."""
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"lathe export: {hf_dir} has no config.json: not a Hugging Face checkpoint "
                                "(was it written by a lathe run that saved checkpoints?)")
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    missing = [f for f in files if not (hf_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"lathe export: {hf_dir} lacks {', '.join(missing)} (the save was cut short, or "
                                "files were removed); export another step with --step.")
    return files


def verify_for_export(ckpt: Path, part: str = "actor") -> bool:
    """`manifest.check` with `lathe export`'s fix; False (and a warning) for a checkpoint without a manifest."""
    def fix(good: Path | None) -> str:
        if good is None:
            return "restore the file from a copy; this run has no other checkpoint to export."
        return (f"export that one (lathe export {ckpt.parent} OUT_DIR --step {_step_of(good)} --part {part}), "
                "or restore the file from a copy.")
    return manifest.check(ckpt, fix=fix, prefix="lathe export: ")


def export(source: str | Path, out: str | Path, *, step: int | None = None, part: str = "actor",
           force: bool = False) -> Path:
    """Copy `part`'s Hugging Face directory of the chosen checkpoint to `out`; return `out`."""
    if part not in PARTS:
        raise ValueError(f"lathe export: --part {part!r}; use one of {', '.join(PARTS)}")
    ckpt = find_checkpoint(source, step)
    hf_dir = ckpt / part / "huggingface"
    if not hf_dir.is_dir():
        have = [p for p in PARTS if (ckpt / p / "huggingface").is_dir()]
        raise FileNotFoundError(f"lathe export: {ckpt} has no {part} (it has {', '.join(have) or 'nothing'}).")
    verify_for_export(ckpt, part)
    check_complete(hf_dir)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"lathe export: {out} exists and is not empty. Fix: choose another directory, "
                                  "or pass --force to replace it.")
        shutil.rmtree(out)
    shutil.copytree(hf_dir, out, dirs_exist_ok=True)
    return out


def check_loads(path: str | Path, part: str = "actor") -> dict:
    """Load an exported directory with transformers (model and tokenizer) and run one forward; what it found."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    cls = AutoModelForCausalLM if part == "actor" else AutoModelForTokenClassification
    model = cls.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("1+1=", return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise ValueError(f"lathe export: the tokenizer in {path} encodes text to nothing")
    with torch.no_grad():
        logits = model(ids).logits
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "tokens": ids.shape[-1], "logits_finite": bool(torch.isfinite(logits).all())}
