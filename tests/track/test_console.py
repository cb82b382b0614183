import torch

from lathe.track.console import brief, format_step_line

FULL = {
    "critic/score/mean": 0.62,
    "actor/pg_loss": -0.013,
    "actor/kl_loss": 0.0012,
    "actor/entropy": 1.234,
    "response_length/mean": 4.1,
    "timing_s/gen": 0.41,
    "timing_s/step": 1.2,
    "perf/throughput": 3200.0,
    "actor/lr": 1e-6,  # present but not important: not on the line
}


def test_line_matches_example():
    assert format_step_line(12, 60, FULL) == (
        "step 12/60 | score 0.62 | pg_loss -0.013 | kl 0.0012 | entropy 1.23 | resp_len 4.1 | "
        "gen 0.41s | step 1.20s | 3.2k tok/s"
    )


def test_a_multi_turn_step_shows_its_tool_calls_after_the_score():
    line = format_step_line(5, 40, {"critic/score/mean": 0.5, "agent/tool_calls/mean": 0.75, "timing_s/step": 1.5})
    assert line == "step 5/40 | score 0.5 | tool_calls 0.75 | step 1.50s"


def test_missing_keys_are_skipped_and_total_optional():
    line = format_step_line(3, None, {"actor/pg_loss": torch.tensor(0.5), "timing_s/step": 125.0})
    assert line == "step 3 | pg_loss 0.5 | step 125s"


def test_kl_falls_back_and_val_core_uses_largest_n():
    metrics = {
        "actor/reward_kl_penalty": 0.02,
        "val-core/openai/gsm8k/reward/mean@1": 0.4,
        "val-core/openai/gsm8k/reward/mean@4": 0.55,
        "val-aux/openai/gsm8k/reward/mean@4": 0.9,
        "perf/throughput": 850.0,
    }
    assert format_step_line(5, 10, metrics) == "step 5/10 | kl 0.02 | 850 tok/s | val[openai/gsm8k] 0.55"


def test_number_formats():
    line = format_step_line(1, 2, {"response_length/mean": 1234.6, "actor/pg_loss": 3e-7, "perf/throughput": 2.5e6})
    assert "resp_len 1235" in line and "pg_loss 3.0e-07" in line and "2.5M tok/s" in line


def test_reward_left_out_when_it_reads_as_the_score_and_eta_last():
    same = {"critic/score/mean": 0.4, "critic/rewards/mean": 0.4000001, "timing_s/step": 2.0}
    assert format_step_line(3, 10, same, eta_s=14.0) == "step 3/10 | score 0.4 | step 2.00s | eta 14s"
    kl = {"critic/score/mean": 0.4, "critic/rewards/mean": 0.38}          # a KL penalty in the reward: both
    assert format_step_line(3, 10, kl) == "step 3/10 | score 0.4 | reward 0.38"


def test_brief_is_the_score_or_the_sft_loss():
    assert brief({"critic/score/mean": torch.tensor(0.75), "train/loss": 1.0}) == "score 0.75"
    assert brief({"train/loss": 1.25}) == "loss 1.25" and brief({}) == ""


def test_a_pf_ppo_step_shows_the_sampled_score_not_the_redrawn_batchs():
    metrics = {"pf_ppo/score_before/mean": 0.6, "critic/score/mean": 0.9, "timing_s/step": 1.0}
    assert format_step_line(2, 5, metrics) == "step 2/5 | score 0.6 | step 1.00s"
