"""lathe.algo.distillation against references written from the formulas (float64), and its edge cases."""

import math

import pytest
import torch

from lathe.algo.distillation import (DistillationParams, combine_losses, distillation_loss, distillation_token_losses,
                                     forward_kl_topk, topk_losses)


def _case(seed: int = 0, B: int = 3, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    student = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return student, teacher, mask


def _ref_estimator(s: float, t: float, mode: str) -> float:
    """Schulman's estimators of KL(pi || q) from a sample of pi, with log pi = s, log q = t."""
    r = math.exp(t - s)                                      # q / pi
    return {"k1": s - t, "kl": s - t, "abs": abs(s - t), "k2": 0.5 * (s - t) ** 2, "mse": 0.5 * (s - t) ** 2,
            "k3": r - 1 - math.log(r), "low_var_kl": r - 1 - math.log(r)}[mode]


@pytest.mark.parametrize("mode", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_token_losses_are_schulmans_estimators(mode):
    s, t, _ = _case()
    got = distillation_token_losses(s, t, mode)
    want = torch.tensor([[_ref_estimator(a, b, mode) for a, b in zip(rs.tolist(), rt.tolist())]
                         for rs, rt in zip(s, t)], dtype=torch.float64)
    torch.testing.assert_close(got, want)


def _on_policy(seed: int, mode: str, pg: bool):
    """(student log-probs with a gradient, teacher, mask, loss, metrics) of an on-policy (ratio 1) token-mean loss."""
    s, t, mask = _case(seed)
    s = s.clone().requires_grad_(True)
    loss, metrics = distillation_loss(s, s.detach(), t, mask, DistillationParams(loss_mode=mode, use_policy_gradient=pg),
                                      loss_agg_mode="token-mean")
    return s, t, mask, loss, metrics


def test_supervised_k3_is_the_masked_token_mean_and_its_gradient():
    s, t, mask, loss, metrics = _on_policy(1, "k3", False)
    n = mask.sum()
    d = (s - t).detach()
    per = torch.exp(-d) - 1 + d                               # k3 with log(q/pi) = -d
    assert float(loss.detach()) == pytest.approx(float((per * mask).sum() / n), rel=1e-12)
    loss.backward()
    # d/ds [exp(t - s) - 1 + s - t] = 1 - exp(t - s), over the valid tokens / N
    torch.testing.assert_close(s.grad, (1 - torch.exp(-d)) * mask / n)
    valid = per[mask.bool()]
    assert float(metrics["distillation/loss_min"]) == pytest.approx(float(valid.min()))
    assert float(metrics["distillation/loss_max"]) == pytest.approx(float(valid.max()))
    assert float(metrics["distillation/abs_loss"]) == pytest.approx(float(valid.abs().mean()))


def test_policy_gradient_k1_uses_the_negative_loss_as_the_advantage():
    s, t, mask, loss, metrics = _on_policy(2, "k1", True)
    n = mask.sum()
    adv = (t - s).detach()                                    # -k1 = log q - log pi: the reward per token
    # on-policy the ratio is 1: loss = -mean(A), d loss / d log pi = -A / N
    assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / n), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(s.grad, -adv * mask / n)
    assert {"distillation/pg_clipfrac", "distillation/ppo_kl", "distillation/pg_clipfrac_lower"} <= set(metrics)


def test_policy_gradient_clips_with_the_distillation_clip_ratio():
    s, t, mask = _case(3)
    old = s - 0.5                                             # ratio e^0.5 ~ 1.65 > 1 + 0.2 everywhere
    p = DistillationParams(loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss, metrics = distillation_loss(s, old, t, mask, p)
    adv = (t - s)
    ratio = torch.exp(s - old)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per = torch.where(adv < 0, torch.minimum(per, -adv * 3.0), per)
    assert float(loss) == pytest.approx(float((per * mask).sum() / mask.sum()), rel=1e-12)
    assert float(metrics["distillation/pg_clipfrac"]) > 0


def test_loss_max_clamp_bounds_both_sides():
    s, t, mask = _case(4)
    t = t - 20.0                                             # k1 = s - t ~ 20 > clamp
    p = DistillationParams(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=10.0)
    loss, metrics = distillation_loss(s, s.detach(), t, mask, p)
    assert float(loss) == pytest.approx(10.0, rel=1e-12)      # advantage -10 everywhere, ratio 1
    assert float(metrics["distillation/loss_max"]) > 10.0     # the metrics see the unclamped losses (as verl's)


@pytest.mark.parametrize("mode,pg", [("k1", True), ("k3", False), ("k3", True), ("k2", False)])
def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient(mode, pg):
    s, _, mask = _case(5)
    s = s.clone().requires_grad_(True)
    loss, metrics = distillation_loss(s, s.detach(), s.detach(), mask,
                                      DistillationParams(loss_mode=mode, use_policy_gradient=pg))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(s.grad.abs().max()) == 0.0
    assert float(metrics["distillation/abs_loss"]) == 0.0


def test_combine_losses_weights_or_replaces_the_task_loss():
    task, distill = torch.tensor(2.0), torch.tensor(3.0)
    with_task = DistillationParams(use_task_rewards=True, distillation_loss_coef=0.5)
    assert float(combine_losses(task, distill, with_task)) == 3.5
    assert float(combine_losses(task, distill, DistillationParams(use_task_rewards=False,
                                                                  distillation_loss_coef=0.5))) == 3.0


def test_k1_without_policy_gradient_and_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="use_policy_gradient=true"):
        DistillationParams(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="loss_mode='k7'"):
        DistillationParams(loss_mode="k7")
    with pytest.raises(ValueError, match="topk=None"):
        DistillationParams(loss_mode="forward_kl_topk")


def _log_softmax(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=g, dtype=torch.float64) * 2, dim=-1)


def test_forward_kl_topk_with_the_whole_vocabulary_is_the_forward_kl():
    B, T, V = 2, 3, 7
    student, teacher = _log_softmax(0, (B, T, V)), _log_softmax(1, (B, T, V))
    ids = torch.argsort(teacher, dim=-1, descending=True)
    losses = forward_kl_topk(student.gather(-1, ids), teacher.gather(-1, ids))
    want = torch.tensor([[sum(math.exp(teacher[b, i, v]) * (teacher[b, i, v] - student[b, i, v]) for v in range(V))
                          for i in range(T)] for b in range(B)], dtype=torch.float64)
    torch.testing.assert_close(losses.double(), want)
    _, metrics = topk_losses(student.gather(-1, ids), teacher.gather(-1, ids), ids, ids, torch.ones(B, T),
                             DistillationParams(loss_mode="forward_kl_topk", topk=V))
    assert float(metrics["distillation/student_mass"]) == pytest.approx(1.0)
    assert float(metrics["distillation/teacher_mass_min"]) == pytest.approx(1.0)
    assert float(metrics["distillation/overlap_ratio"]) == 1.0


def test_forward_kl_topk_truncates_clamps_and_floors_at_zero():
    V, k, floor = 9, 3, -2.0
    student, teacher = _log_softmax(2, (1, 4, V)), _log_softmax(3, (1, 4, V))
    top = torch.topk(teacher, k, dim=-1)
    mine = torch.topk(student, k, dim=-1).indices
    losses, metrics = topk_losses(student.gather(-1, top.indices), top.values, top.indices, mine, torch.ones(1, 4),
                                  DistillationParams(loss_mode="forward_kl_topk", topk=k, log_prob_min_clamp=floor))
    shared = [len(set(top.indices[0, i].tolist()) & set(mine[0, i].tolist())) for i in range(4)]
    assert float(metrics["distillation/overlap_ratio"]) == pytest.approx(sum(shared) / 4 / k)
    for i in range(4):
        ids = top.indices[0, i].tolist()
        q = [max(float(teacher[0, i, v]), floor) for v in ids]
        p = [max(float(student[0, i, v]), floor) for v in ids]
        want = max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(q, p)))
        assert float(losses[0, i]) == pytest.approx(want, rel=1e-6, abs=1e-12)
    s_mass = [sum(math.exp(float(student[0, i, v])) for v in top.indices[0, i].tolist()) for i in range(4)]
    assert float(metrics["distillation/student_mass"]) == pytest.approx(sum(s_mass) / 4)
    assert float(metrics["distillation/student_mass_max"]) == pytest.approx(max(s_mass))


def test_a_batch_without_valid_tokens_gives_neutral_extremes():
    s, t, mask = _case(6)
    loss, metrics = distillation_loss(s, s, t, torch.zeros_like(mask), DistillationParams())
    assert float(loss) == 0.0 and float(metrics["distillation/abs_loss"]) == 0.0
    assert metrics["distillation/loss_min"] == math.inf and metrics["distillation/loss_max"] == -math.inf
