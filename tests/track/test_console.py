import io

import torch

from lathe.track.console import ProgressBar, format_step_line

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


def test_progress_bar_off_when_not_tty_but_write_prints():
    out = io.StringIO()
    bar = ProgressBar(10, initial=3, file=out)
    assert not bar.enabled
    bar.update(4, {"critic/score/mean": 0.5})
    bar.write("hello line")
    bar.close()
    assert out.getvalue() == "hello line\n"


def test_progress_bar_forced_starts_at_resume_step_and_shows_score():
    out = io.StringIO()
    bar = ProgressBar(10, initial=3, file=out, force=True)
    bar.update(5, {"critic/score/mean": torch.tensor(0.75)})
    assert bar.bar.n == 5
    bar.write("step 5/10 | score 0.75")
    bar.close()
    text = out.getvalue()
    assert "5/10" in text and "score 0.75" in text and "step 5/10 | score 0.75\n" in text
