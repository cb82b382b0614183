"""lathe.workers.teacher: teacher log-probs of the student's responses, routing by data_source, vocabulary checks."""

import numpy as np
import pytest
import torch

from lathe.config.distill import TeacherSpec
from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model
from lathe.train.logprob import batched_log_probs
from lathe.workers.teacher import Teacher, check_vocabulary


def _saved(tmp_path, seed: int) -> str:
    """A tiny random checkpoint with the built-in tokenizer (a teacher of the student's family)."""
    tok = builtin_tokenizer()
    path = tmp_path / f"teacher{seed}"
    build_builtin_model("tiny", vocab_size=len(tok), seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _reference(seed: int, batch) -> torch.Tensor:
    """The log-probs a teacher should give: its checkpoint's (the built-in model of `seed`), by the reference's code,
    padded (the teacher runs packed), at temperature 1."""
    model = build_builtin_model("tiny", vocab_size=len(builtin_tokenizer()), seed=seed)
    return batched_log_probs(model, batch, micro_batch_size=3, temperature=1.0)[0]


def test_teachers_score_their_own_rows(load_cfg, rollout_batch, tmp_path):
    cfg = load_cfg("actor_rollout_ref.model.use_remove_padding=true")
    a, b = _saved(tmp_path, 1), _saved(tmp_path, 2)
    teacher = Teacher([TeacherSpec("ta", "src/a", a), TeacherSpec("tb", "src/b", b)], cfg.actor_rollout_ref,
                      builtin_tokenizer(), device=torch.device("cpu"), sharded=False)
    batch = rollout_batch(rows=6, seed=3)
    batch.non_tensors["data_source"] = np.array(["src/a", "src/b", "src/b", "src/a", "src/b", "src/a"], dtype=object)
    got = teacher.compute_teacher_log_prob(batch, micro_batch_size=2)["teacher_log_probs"]
    rows_a = [0, 3, 5]
    want = torch.where(torch.tensor([i in rows_a for i in range(6)]).unsqueeze(1),
                       _reference(1, batch), _reference(2, batch))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert float(got[~mask].abs().max()) == 0.0
    batch.non_tensors["data_source"][1] = "src/c"
    with pytest.raises(ValueError, match=r"data_source \['src/c'\] have no teacher"):
        teacher.compute_teacher_log_prob(batch, micro_batch_size=2)


def test_a_teacher_of_another_vocabulary_is_refused():
    spec = TeacherSpec("teacher_model", None, "/ckpt/other")
    student = builtin_tokenizer()

    class Other:
        def get_vocab(self):
            vocab = dict(student.get_vocab())
            first = next(iter(vocab))
            vocab[first] = 10**6
            return vocab

    with pytest.raises(ValueError, match="teacher's tokenizer differs from the student's"):
        check_vocabulary(spec, Other(), student, len(student))
    with pytest.raises(ValueError, match="output layer has 3 rows"):
        check_vocabulary(spec, student, student, 3)
    check_vocabulary(spec, student, student, len(student))
