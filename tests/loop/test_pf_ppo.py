"""PF-PPO (`algorithm.use_pf_ppo`): the redraw step (`lathe.loop.steps.resample_by_score`), a `lathe train` run with
it, a resumed run that redraws as the uninterrupted one, and the fully-async trainer's redraw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lathe.batch import Batch
from lathe.config import load_config
from lathe.loop.steps import resample_by_score

from loop.test_async_inprocess import COMPARED, ON_POLICY, assert_same_steps, start_in_process
from loop.test_async_inprocess import train as async_train

from .test_algorithms import train
from .test_ppo import deterministic, read_metrics, run_crash_and_resume

GAE_PF_PPO = ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true"]


def scored_batch(scores: list[float], width: int = 3) -> Batch:
    """Rows 0..B-1 with their score on the last token, a `row` tensor and a `uid` naming each row's prompt."""
    B = len(scores)
    token_scores = torch.zeros(B, width)
    token_scores[:, -1] = torch.tensor(scores)
    return Batch({"token_level_scores": token_scores, "row": torch.arange(B),
                  "advantages": torch.arange(B * width, dtype=torch.float32).reshape(B, width)},
                 {"uid": [f"p{i // 2}" for i in range(B)], "tag": [f"r{i}" for i in range(B)]}, {"kept": 1})


def algo(method: str = "pow", power: float = 2.0):
    return load_config(None, [*GAE_PF_PPO, f"algorithm.pf_ppo.reweight_method={method}",
                              f"algorithm.pf_ppo.weight_pow={power}"]).algorithm


def test_the_redraw_carries_whole_rows_and_leaves_the_batch_alone():
    batch = scored_batch([0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 0.0, 0.75])
    before = {k: v.clone() for k, v in batch.tensors.items()}
    out, metrics = resample_by_score(batch, algo(), seed=7, step=3)
    rows = out["row"]
    assert len(out) == len(batch) and out.meta == {"kept": 1}
    assert torch.equal(rows, rows.sort().values)                       # batch order: a prompt's rows together
    for key in ("token_level_scores", "advantages"):
        assert torch.equal(out[key], batch[key][rows])
    assert list(out["uid"]) == [batch["uid"][i] for i in rows] and list(out["tag"]) == [f"r{i}" for i in rows]
    assert all(torch.equal(before[k], batch[k]) for k in before)       # the caller's batch: as it was
    assert metrics["pf_ppo/distinct_rows"] == len(set(rows.tolist())) < len(batch)
    assert metrics["pf_ppo/score_before/mean"] == pytest.approx(3.5 / 8)
    assert not set(rows.tolist()) & {0, 3, 6}                          # score 0 under pow: weight 1e-8


def test_the_redraw_is_seeded_by_the_run_seed_and_the_step_alone():
    batch = scored_batch(list(np.linspace(-1, 1, 16)))
    draw = lambda seed, step: resample_by_score(batch, algo("pow", 1.0), seed, step)[0]["row"]  # noqa: E731
    global_rng = torch.get_rng_state()
    assert torch.equal(draw(1, 5), draw(1, 5))
    assert torch.equal(torch.get_rng_state(), global_rng)   # its own generator: other draws neither move it nor it them
    assert not torch.equal(draw(1, 5), draw(1, 6)) and not torch.equal(draw(1, 5), draw(2, 5))


@pytest.mark.parametrize("method", ["pow", "max_random"])
def test_a_run_with_pf_ppo_trains_on_the_redrawn_batch(tmp_path, method):
    metrics = train(tmp_path, *GAE_PF_PPO, f"algorithm.pf_ppo.reweight_method={method}")
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert 1 <= m["pf_ppo/distinct_rows"] <= 16 and "critic/vf_loss" in m and m["actor/grad_norm"] > 0
        before, after = m["pf_ppo/score_before/mean"], m["critic/score/mean"]
        if method == "pow" and before > 0:            # 0/1 scores: a row scoring 0 weighs 1e-8 against 1s
            assert after == 1.0 and m["pf_ppo/distinct_rows"] <= round(16 * before)


def test_resume_redraws_as_the_uninterrupted_run(tmp_path, monkeypatch):
    common = [*GAE_PF_PPO, "algorithm.pf_ppo.reweight_method=max_random", "trainer.total_training_steps=4",
              "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false", "reward.timeout_s=0",
              "critic.ppo_mini_batch_size=2"]
    whole, resumed = run_crash_and_resume(tmp_path, monkeypatch, common)
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step]["pf_ppo/distinct_rows"] < 16, "every row drawn once: the test would not see the redraw"
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    for (name, p), q in zip(whole.worker.model.named_parameters(), resumed.worker.model.parameters()):
        assert torch.equal(p, q), name


def test_on_policy_fully_async_redraws_as_the_synchronous_loop(tmp_path, monkeypatch):
    """The fully-async trainer thread learns through the same step (`learn`): on-policy, its redraw and update are the
    synchronous loop's (both pools in this process: tests/loop/test_async_inprocess.py)."""
    import lathe.cluster
    monkeypatch.setattr(lathe.cluster, "start_async_cluster", start_in_process)
    sync = async_train(tmp_path / "sync", *GAE_PF_PPO)
    on_policy = async_train(tmp_path / "async", *GAE_PF_PPO, *ON_POLICY)
    assert_same_steps(sync, on_policy, keys=(*COMPARED, "pf_ppo/distinct_rows", "pf_ppo/score_before/mean",
                                             "critic/vf_loss"))
    assert any(r["pf_ppo/distinct_rows"] < 16 for r in sync), "every row drawn once: the test would not see the redraw"
