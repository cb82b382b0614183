"""`lathe report`: one self-contained HTML page from a run directory (lathe/report/)."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lathe.cli import main
from lathe.data import arithmetic_rows
from lathe.report import load_run, write_report
from lathe.report.svg import nice_ticks

EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def synthetic_run(run_dir: Path, steps: int = 30) -> Path:
    """A GRPO-like run: every panel's metrics, validation every 5 steps, a NaN, samples, and a saved config."""
    records = [{"step": 0, "val-core/lathe/arithmetic/reward/mean@1": 0.2}]
    for s in range(1, steps + 1):
        r = {"step": s, "critic/score/mean": 0.2 + 0.6 * s / steps + 0.05 * math.sin(s),
             "critic/rewards/mean": 0.18 + 0.6 * s / steps, "actor/kl_loss": 0.001 * s, "actor/ppo_kl": 1e-4,
             "actor/entropy": 1.5 - s / steps, "actor/pg_loss": 0.01 * math.cos(s), "actor/grad_norm": 2 + s % 3,
             "response_length/mean": 40 + s, "response_length/max": 64, "response_length/clip_ratio": 0.1,
             "timing_s/gen": 1.0, "timing_s/old_log_prob": 0.2, "timing_s/ref": 0.2, "timing_s/adv": 0.01,
             "timing_s/update_actor": 1.5, "timing_s/step": 3.0, "perf/throughput": 1000 + 10 * s,
             "perf/time_per_step": 3.0, "perf/max_memory_allocated_gb": 10.5, "perf/max_memory_reserved_gb": 12.0,
             "perf/cpu_memory_used_gb": 30.0}
        if s % 5 == 0:
            r["val-core/lathe/arithmetic/reward/mean@1"] = 0.2 + 0.02 * s
            r["val-aux/lathe/arithmetic/reward/std@1"] = 0.3
        records.append(r)
    records[7]["actor/grad_norm"] = float("nan")
    records[9]["actor/grad_norm"] = float("inf")
    write_metrics(run_dir, records)
    val = run_dir / "val"
    for s in (0, 5, 10):
        rows = [{"input": f"{i}+{i}=", "output": EVIL if i == 1 else str(2 * i), "gts": str(2 * i),
                 "score": float(i != 1), "step": s} for i in range(10)]
        (val / f"{s}.jsonl").parent.mkdir(exist_ok=True)
        (val / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text(
        f"trainer:\n  project_name: demo\n  experiment_name: grpo-{EVIL}\n  validation_data_dir: {val}\n"
        "actor_rollout_ref:\n  model:\n    path: Qwen/Qwen2.5-0.5B-Instruct\nalgorithm:\n  adv_estimator: grpo\n")
    return run_dir


def test_report_has_a_chart_per_panel_the_header_and_the_samples(tmp_path):
    out = write_report(synthetic_run(tmp_path / "run"), max_samples=3)
    assert out == tmp_path / "run" / "report.html"
    html = out.read_text()
    for title in ("Score and reward", "Validation", "KL", "Entropy", "Response length", "Responses clipped at max "
                  "length", "Policy loss", "Gradient norm", "Time per phase", "Throughput", "Time per step", "Memory",
                  "Validation, more"):
        assert f"<h3>{title}</h3>" in html
    assert html.count("<svg") == 13 and "Value loss" not in html          # no critic metrics: no panel
    assert "Qwen/Qwen2.5-0.5B-Instruct" in html and ">grpo<" in html and ">demo<" in html
    assert "final 0.8" in html and "time in steps" in html and "<details><summary>Config" in html
    assert "2 NaN/infinite value(s)" in html and 'class="bad"' in html
    assert "<title>critic/score/mean at step 3: " in html                  # hover titles on points
    assert html.count("<tr><td class=\"num\">10</td>") == 3                # 3 samples of the latest step file
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing loaded from anywhere


def test_model_output_cannot_inject_markup(tmp_path):
    html = write_report(synthetic_run(tmp_path / "run"), max_samples=10).read_text()
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html    # shown as text, in the samples and title


def test_resumed_run_shows_the_last_value_per_step(tmp_path):
    run_dir = tmp_path / "run"
    records = [{"step": s, "critic/score/mean": 0.1 * s} for s in (1, 2, 3, 4)]
    records += [{"step": s, "critic/score/mean": 1.0 + s} for s in (3, 4, 5)]   # resumed at 2, not truncated
    records.append({"step": 5, "val-core/x/reward/mean@1": 0.5})                 # logged apart: merged in
    write_metrics(run_dir, records)
    run = load_run(run_dir)
    assert run.series("critic/score/mean") == [(1, 0.1), (2, 0.2), (3, 4.0), (4, 5.0), (5, 6.0)]
    assert run.metrics[5] == {"critic/score/mean": 6.0, "val-core/x/reward/mean@1": 0.5}
    assert "final 6 (step 5), best 6 (step 5)" in write_report(run_dir).read_text()


def test_absent_metrics_and_non_numbers_are_skipped(tmp_path):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [{"step": 1, "my/metric": 2.0, "note": "text", "flag": True}])
    html = write_report(run_dir, out=tmp_path / "elsewhere" / "r.html").read_text()
    assert "<svg" not in html and "None of the plotted metrics" in html
    assert "my/metric" in html and ">note<" not in html and "No saved config" in html


def test_config_saved_by_wandb_is_read(tmp_path):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [{"step": 1, "critic/score/mean": 0.5}])
    (run_dir / "wandb/latest-run/files").mkdir(parents=True)
    (run_dir / "wandb/latest-run/files/config.yaml").write_text(
        "_wandb:\n  value: {cli_version: 0.19}\ntrainer:\n  desc: null\n  value: {project_name: gsm8k}\n")
    run = load_run(run_dir)
    assert run.config == {"trainer": {"project_name": "gsm8k"}} and run.setting("trainer.project_name") == "gsm8k"


def test_ticks_are_round_numbers_inside_the_range():
    assert nice_ticks(0.31, 0.42) == [0.32, 0.34, 0.36, 0.38, 0.4, 0.42]
    assert nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]


def test_cli_writes_the_report_and_explains_a_directory_without_metrics(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run", steps=10)
    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html"), "--max-samples", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.html")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} holds no metrics.jsonl" in err and "Traceback" not in err
    write_metrics(tmp_path / "empty", [])
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no step records" in capsys.readouterr().err


@pytest.mark.slow
def test_report_of_a_real_cpu_run(tmp_path):
    """Two steps of the built-in task (no warm start: a report needs metrics, not a good model; 8 validation
    prompts): every panel the CPU run has metrics for, and its samples."""
    run_dir, val = tmp_path / "run", tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(arithmetic_rows(8, seed=1, split="val", max_operand=9)), val)
    assert main(["train", "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
                 "trainer.test_freq=1", f"data.val_files={val}", f"trainer.default_local_dir={run_dir}",
                 f"trainer.validation_data_dir={run_dir / 'val'}", f"trainer.rollout_data_dir={run_dir / 'rollout'}",
                 "trainer.logger=[console]", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=4"]) == 0
    html = write_report(run_dir, val_dir=run_dir / "val", rollout_dir=run_dir / "rollout").read_text()
    for title in ("Score and reward", "Validation", "KL", "Entropy", "Response length", "Policy loss",
                  "Gradient norm", "Time per phase", "Throughput", "Time per step"):
        assert f"<h3>{title}</h3>" in html, title
    assert "critic/score/mean</dt>" in html and "val-core/lathe/arithmetic/reward/mean@1</dt>" in html
    assert "2 of its 2 step files" in html and "3 of its 3 step files" in html      # rollouts 1-2, validations 0-2


# --- headless chromium: the page renders -----------------------------------------------------------------------

def png_pixels(path: Path, max_rows: int | None = None) -> np.ndarray:
    """(height, width, channels) uint8 of an 8-bit RGB/RGBA PNG (its top ``max_rows`` rows), with the stdlib and
    numpy only.

    Scanline filters are undone along anti-diagonals: a pixel's predictors (left, up, up-left) all lie on earlier
    diagonals, so each diagonal is one vectorised step."""
    data, pos, idat = path.read_bytes(), 8, b""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body, pos = data[pos + 8:pos + 8 + length], pos + 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, "only 8-bit RGB(A), non-interlaced"
        elif kind == b"IDAT":
            idat += body
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    height = min(height, max_rows or height)
    kinds, filtered = raw[:height, 0], raw[:height, 1:].reshape(height, width, bpp).astype(np.int16)
    out = np.zeros((height + 1, width + 1, bpp), np.int16)      # a zero row above, a zero column to the left
    all_rows = np.arange(height)
    for d in range(height + width - 1):
        r = all_rows[max(0, d - width + 1):min(height, d + 1)]
        c = d - r
        a, b, ul = out[r + 1, c], out[r, c + 1], out[r, c]
        p = a + b - ul
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - ul)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, ul))
        k = kinds[r][:, None]
        pred = np.select([k == 1, k == 2, k == 3, k == 4], [a, b, (a + b) // 2, paeth], 0)
        out[r + 1, c + 1] = (filtered[r, c] + pred) % 256
    return out[1:, 1:].astype(np.uint8)


def test_png_decoder_reads_every_filter(tmp_path):
    """A 3x2 RGB image written with filters None, Sub, Up, Average, Paeth on its rows decodes back."""
    image = np.array([[[10, 20, 30], [200, 100, 0], [255, 255, 255]],
                      [[0, 0, 0], [90, 80, 70], [1, 2, 3]]], np.uint8)
    for kind in range(5):
        rows = b""
        for y in range(2):
            line = image[y].astype(np.int32).reshape(-1)
            prev = image[y - 1].astype(np.int32).reshape(-1) if y else np.zeros_like(line)
            left = np.concatenate([np.zeros(3, np.int32), line[:-3]])
            up_left = np.concatenate([np.zeros(3, np.int32), prev[:-3]])
            p = left + prev - up_left
            paeth = np.where((abs(p - left) <= abs(p - prev)) & (abs(p - left) <= abs(p - up_left)), left,
                             np.where(abs(p - prev) <= abs(p - up_left), prev, up_left))
            pred = [0 * line, left, prev, (left + prev) // 2, paeth][kind]
            rows += bytes([kind]) + ((line - pred) % 256).astype(np.uint8).tobytes()

        def chunk(kind_: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind_ + body + struct.pack(">I", zlib.crc32(kind_ + body))
        png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 2, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
        (tmp_path / "t.png").write_bytes(png)
        assert (png_pixels(tmp_path / "t.png") == image).all(), f"filter {kind}"


def chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome"))), None)


@pytest.mark.skipif(chromium() is None, reason="no chromium binary (Debian: apt-get install chromium)")
def test_headless_chromium_renders_the_charts(tmp_path):
    html = write_report(synthetic_run(tmp_path / "run"))
    shot = tmp_path / "shot.png"
    # --no-sandbox: chromium refuses to run as root without it; a private profile leaves nothing in ~/.config
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1200,2000", html.as_uri()], capture_output=True, timeout=60, check=True)
    assert struct.unpack(">II", shot.read_bytes()[16:24]) == (1200, 2000)
    charts = png_pixels(shot, max_rows=1300)[300:, :, :3].reshape(-1, 3)      # below the header: charts
    colours = np.unique(charts, axis=0)
    not_white = (charts < 235).any(axis=1).mean()
    blue = (np.abs(charts.astype(int) - (31, 119, 180)).sum(axis=1) < 30).sum()   # the first series' colour
    assert len(colours) > 100 and 0.02 < not_white < 0.5 and blue > 500, (len(colours), not_white, blue)


def test_power_per_phase_in_pipeline_order(tmp_path):
    from lathe.report.page import panel_keys
    keys = ["perf/power_w/update_actor", "perf/power_w/zeta", "perf/power_w/gen", "perf/power_w/ref", "timing_s/gen"]
    assert panel_keys("perf/power_w/", keys) == ["perf/power_w/gen", "perf/power_w/ref", "perf/power_w/update_actor",
                                                 "perf/power_w/zeta"]
    run = synthetic_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        if "timing_s/gen" in row:
            row.update({"perf/power_w/gen": 650.0, "perf/power_w/update_actor": 695.0, "perf/power_limit_w": 700.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = write_report(run, max_samples=3).read_text()
    assert "<h3>GPU power per phase</h3>" in html and html.count("<svg") == 14
