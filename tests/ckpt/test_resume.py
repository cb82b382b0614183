"""`lathe.ckpt.resume.check_lora`: a checkpoint resumes only with the LoRA it was trained with, refused before any
model loads otherwise; and the loader's own guard when a LoRA checkpoint meets a model without adapters."""

import json

import pytest

from lathe.ckpt.resume import adapter_rank, check_lora

KEY = "actor_rollout_ref.model.lora_rank"


def _checkpoint(tmp_path, rank: int | None):
    step = tmp_path / "global_step_2"
    (step / "actor" / "huggingface").mkdir(parents=True)
    if rank is not None:
        (step / "actor" / "lora_adapter").mkdir()
        (step / "actor" / "lora_adapter" / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return step


@pytest.mark.parametrize("saved, asked, fix", [
    (8, 0, f"resume with {KEY}=8, or start a new run from its merged weights"),
    (8, 16, f"resume with {KEY}=8."),
    (None, 8, f"resume with {KEY}=0, or start a new run with LoRA from its weights"),
])
def test_a_checkpoint_resumes_only_with_the_lora_it_was_trained_with(tmp_path, saved, asked, fix):
    step = _checkpoint(tmp_path, saved)
    with pytest.raises(ValueError, match=f"this run has {KEY}={asked}") as err:
        check_lora(step, {"actor": (KEY, asked)})
    assert fix in str(err.value)
    check_lora(step, {"actor": (KEY, saved or 0), "critic": ("critic.model.lora_rank", 4)})   # (no critic saved)
    assert adapter_rank(step / "actor" / "lora_adapter") == saved


def test_the_loader_refuses_a_lora_checkpoint_for_a_model_without_adapters(tmp_path):
    from torch import nn

    from lathe.train.update import load_policy_checkpoint
    step = _checkpoint(tmp_path, 8)
    with pytest.raises(ValueError, match="saved by a run with LoRA .* Fix: resume with the same lora_rank"):
        load_policy_checkpoint(step / "actor", nn.Linear(2, 2), None, None, what="actor")
