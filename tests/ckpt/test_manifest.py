"""lathe.ckpt.manifest on real checkpoints (the policy saver the actor and SFT workers use, full and LoRA): a flipped
byte in a weight or optimizer file, a truncated or a missing file is refused at resume, `lathe export` and
`lathe model check`, naming the file and the last checkpoint that verifies; the fallback flag; a checkpoint from
before manifests loads with a warning."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from lathe.ckpt.checkpoint import find_resume_dir, load_trainer_state, save_checkpoint
from lathe.ckpt.export import export
from lathe.ckpt.manifest import MANIFEST, CheckpointDamaged, hash_files, manifest_cost, verify
from lathe.cli.model_check import run_check
from lathe.config import load_config
from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model, lathe_from_transformers
from lathe.models.lora import apply_lora
from lathe.train.update import load_policy_checkpoint, save_policy_checkpoint

WEIGHTS, OPTIM = "actor/huggingface/model.safetensors", "actor/optim.pt"


class Policy:
    """A tiny policy with its optimizer and schedule, saved and loaded as the actor worker does."""

    def __init__(self, *, lora: bool = False):
        self.tokenizer = builtin_tokenizer()
        self.model = build_builtin_model("tiny", vocab_size=len(self.tokenizer), seed=0)
        if lora:
            self.model = lathe_from_transformers(self.model)
            apply_lora(self.model, rank=2, alpha=4, target_modules="all-linear", exclude_modules=None, seed=0)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def step(self) -> None:
        ids = torch.randint(7, 40, (2, 6), generator=torch.Generator().manual_seed(0))
        self.model(input_ids=ids).logits.float().square().mean().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def save_checkpoint(self, path: Path) -> None:
        save_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, self.tokenizer, base_model=None)

    def load_checkpoint(self, path: Path) -> None:
        load_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, what="actor")


def two_steps(root: Path, *, lora: bool = False) -> Path:
    policy = Policy(lora=lora)
    for step in (1, 2):
        policy.step()
        save_checkpoint(root, step, {"actor": policy}, {"dataloader": {"index": step}})
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return two_steps(tmp_path_factory.mktemp("full") / "run")


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A fresh copy of the saved run (global_step_1, global_step_2 latest) to damage."""
    return Path(shutil.copytree(saved, tmp_path / "run"))


@pytest.fixture(scope="module")
def trainer_cfg():
    return load_config(None, []).trainer


def resume_from(cfg, run: Path, **changes) -> Path | None:
    return find_resume_dir(dataclasses.replace(cfg, default_local_dir=str(run), **changes))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10          # past a safetensors header: in the tensors themselves
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def remove(path: Path) -> None:
    path.unlink()


DAMAGES = [(flip, WEIGHTS, "does not hold what was written"), (flip, OPTIM, "does not hold what was written"),
           (truncate, WEIGHTS, "is truncated"), (remove, WEIGHTS, "is missing"),
           (remove, "trainer_state.pt", "is missing")]
IDS = ["flipped-weights", "flipped-optimizer", "truncated-weights", "missing-weights", "missing-trainer-state"]


def test_the_manifest_lists_every_file_with_its_size_and_hash(saved):
    step = saved / "global_step_2"
    manifest = json.loads((step / MANIFEST).read_text())
    files = sorted(p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest["files"]) == files and {WEIGHTS, OPTIM, "trainer_state.pt"} <= set(files)
    assert manifest["files"][WEIGHTS]["size"] == (step / WEIGHTS).stat().st_size
    assert not list(saved.glob(".*partial*")), "the manifest is written inside the partial directory, then renamed"
    assert verify(step) and verify(saved / "global_step_1")


def test_an_undamaged_run_resumes_exports_and_checks(run, trainer_cfg, tmp_path):
    assert resume_from(trainer_cfg, run) == run / "global_step_2"
    assert (export(run, tmp_path / "out") / "model.safetensors").exists()
    lines = []
    assert run_check(run / "global_step_2", num_batches=1, out=lines.append) == 0, "\n".join(lines)
    assert "matches its manifest.json" in "\n".join(lines)


@pytest.mark.parametrize("damage,file,words", DAMAGES, ids=IDS)
def test_a_damaged_checkpoint_is_refused_at_resume(run, trainer_cfg, damage, file, words):
    damage(run / "global_step_2" / file)
    with pytest.raises(CheckpointDamaged) as caught:
        resume_from(trainer_cfg, run)
    text = str(caught.value)
    assert file in text and words in text and str(run / "global_step_2") in text, text
    assert "verifies is global_step_1" in text and "trainer.resume_fallback_to_verified=true" in text, text
    assert f"trainer.resume_from_path={run / 'global_step_1'}" in text, text


@pytest.mark.parametrize("damage,file,words", DAMAGES, ids=IDS)
def test_a_damaged_checkpoint_is_refused_by_export(run, tmp_path, damage, file, words):
    damage(run / "global_step_2" / file)
    with pytest.raises(CheckpointDamaged, match=r"^lathe export: checkpoint .*global_step_2 is damaged") as caught:
        export(run, tmp_path / "out")
    text = str(caught.value)
    assert file in text and words in text and "--step 1" in text, text
    assert not (tmp_path / "out").exists()
    assert (export(run, tmp_path / "out", step=1) / "model.safetensors").exists()


@pytest.mark.parametrize("damage,file,words", DAMAGES, ids=IDS)
def test_a_damaged_checkpoint_is_refused_by_model_check(run, damage, file, words):
    damage(run / "global_step_2" / file)
    for given in (run / "global_step_2", run / "global_step_2" / "actor" / "huggingface"):
        lines = []
        assert run_check(given, num_batches=1, out=lines.append) == 1
        text = "\n".join(lines)
        assert "DAMAGED CHECKPOINT" in text and file in text and words in text, text
        assert f"lathe model check {run / 'global_step_1'}" in text and "max |logit diff|" not in text, text


def test_auto_resume_falls_back_to_the_last_verified_checkpoint_only_when_asked(run, trainer_cfg, caplog):
    flip(run / "global_step_2" / WEIGHTS)
    with pytest.raises(CheckpointDamaged):
        resume_from(trainer_cfg, run)
    with caplog.at_level(logging.WARNING, logger="lathe"):
        assert resume_from(trainer_cfg, run, resume_fallback_to_verified=True) == run / "global_step_1"
    assert "Resuming from" in caplog.text and WEIGHTS in caplog.text
    assert load_trainer_state(run / "global_step_1")["dataloader"] == {"index": 1}
    with pytest.raises(CheckpointDamaged):      # a checkpoint named by the user: never another one
        resume_from(trainer_cfg, run, resume_fallback_to_verified=True, resume_mode="resume_path",
                    resume_from_path=str(run / "global_step_2"))
    flip(run / "global_step_1" / OPTIM)         # nothing left that verifies: the error, flag or not
    with pytest.raises(CheckpointDamaged, match="No earlier checkpoint under .* verifies"):
        resume_from(trainer_cfg, run, resume_fallback_to_verified=True)


def test_lathe_train_refuses_a_damaged_checkpoint_before_loading_anything(run, monkeypatch):
    from lathe.loop import setup
    truncate(run / "global_step_2" / WEIGHTS)
    monkeypatch.setattr(setup, "load_tokenizer", lambda *a, **k: pytest.fail("loaded before verifying"))
    cfg = load_config(None, [f"trainer.default_local_dir={run}"])
    with pytest.raises(CheckpointDamaged, match="model.safetensors is truncated"):
        setup.build_trainer(cfg)


def test_a_checkpoint_from_before_manifests_loads_with_one_warning(run, trainer_cfg, tmp_path, caplog):
    (run / "global_step_2" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="lathe"):
        path = resume_from(trainer_cfg, run)
    assert path == run / "global_step_2"
    assert [r.message for r in caplog.records].count(
        f"checkpoint {path} has no {MANIFEST} (it was written before lathe wrote manifests): its files cannot be "
        "verified, and it loads as it is.") == 1
    Policy().load_checkpoint(path / "actor")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lathe"):
        export(run, tmp_path / "out")
    assert "cannot be verified" in caplog.text


def test_a_lora_checkpoint_is_covered_by_the_same_manifest(tmp_path, trainer_cfg):
    run = two_steps(tmp_path / "lora", lora=True)
    adapter = "actor/lora_adapter/adapter_model.safetensors"
    manifest = json.loads((run / "global_step_2" / MANIFEST).read_text())
    assert {adapter, "actor/lora_adapter/adapter_config.json", WEIGHTS, OPTIM} <= set(manifest["files"])
    assert resume_from(trainer_cfg, run) == run / "global_step_2"
    Policy(lora=True).load_checkpoint(run / "global_step_2" / "actor")
    flip(run / "global_step_2" / adapter)
    with pytest.raises(CheckpointDamaged, match=f"{adapter} does not hold what was written"):
        resume_from(trainer_cfg, run)
    assert resume_from(trainer_cfg, run, resume_fallback_to_verified=True) == run / "global_step_1"


def test_block_hashes_do_not_depend_on_the_number_of_threads(tmp_path, monkeypatch):
    import lathe.ckpt.manifest as m
    monkeypatch.setattr(m, "BLOCK_BYTES", 1000)
    files = []
    for size in (0, 999, 1000, 1001, 4321):
        files.append(tmp_path / f"f{size}")
        files[-1].write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    one, many = hash_files(files, threads=1), hash_files(files, threads=3)
    assert one == many and [s for s, _ in one] == [0, 999, 1000, 1001, 4321]
    assert len({h for _, h in one}) == 5
    cost = manifest_cost(tmp_path, threads=2)
    assert cost["files"] == 5 and cost["bytes"] == 7321 and cost["mb_per_s"] > 0


def test_hashing_while_writing_gives_the_digest_of_the_file(tmp_path, monkeypatch):
    import random
    from concurrent.futures import ThreadPoolExecutor

    import lathe.ckpt.manifest as m
    monkeypatch.setattr(m, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(m, "INLINE_BYTES", 100)
    rng = random.Random(0)
    with ThreadPoolExecutor(3) as pool:
        for case in range(12):                 # writes of every size class, across block boundaries
            sizes = [rng.choice([0, 1, 99, 100, 999, 1000, 1001, 2500, 3000]) for _ in range(rng.randint(0, 7))]
            writer = m.HashingWriter(tmp_path / f"w{case}", pool)
            for size in sizes:
                writer.write(rng.randbytes(size))
            assert writer.close() == hash_files([tmp_path / f"w{case}"], threads=2)[0], sizes


def test_a_manifest_from_digests_taken_at_save_equals_one_read_from_disk(tmp_path, monkeypatch):
    import lathe.ckpt.manifest as m
    monkeypatch.setattr(m, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(m, "INLINE_BYTES", 512)
    part = tmp_path / "step" / "actor"
    (part / "huggingface").mkdir(parents=True)
    weights = [part / "huggingface" / f"model-{i}.safetensors" for i in range(2)]
    for i, w in enumerate(weights):
        w.write_bytes(bytes([i]) * (5000 + i))
    m.save_hashed({"state": torch.arange(3000.0), "step": 3}, part / "optim.pt", written=weights)
    assert (part / m.PREHASHED).exists()
    (part / "huggingface" / "tokenizer.json").write_text("{}")       # written after: hashed by write_manifest
    taken = m.write_manifest(tmp_path / "step")
    assert not list((tmp_path / "step").rglob(m.PREHASHED)), "the record is consumed"
    assert taken == m.write_manifest(tmp_path / "step")               # hashed from disk this time
    assert torch.load(part / "optim.pt")["step"] == 3
    m.save_hashed({"x": torch.ones(2000)}, part / "optim.pt")
    with open(part / "optim.pt", "r+b") as f:                           # changed after its digest was taken
        f.seek(100)
        f.write(b"\xff")
    stale = m.write_manifest(tmp_path / "step")["files"]["actor/optim.pt"]
    assert stale == {"size": (part / "optim.pt").stat().st_size, "hash": hash_files([part / "optim.pt"])[0][1]}
