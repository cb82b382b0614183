import json

import pytest

from lathe.track.jsonl import MetricsFile, read_metrics


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_append_is_flushed_every_step(tmp_path):
    mf = MetricsFile(tmp_path / "m.jsonl")
    mf.append(1, {"a": 1.0})
    assert lines(tmp_path / "m.jsonl") == [{"step": 1, "a": 1.0}]  # readable before close
    mf.append(2, {"a": 2.5})
    assert lines(tmp_path / "m.jsonl")[-1] == {"step": 2, "a": 2.5}
    mf.close()


def test_same_step_twice_merges_into_one_line(tmp_path):
    mf = MetricsFile(tmp_path / "m.jsonl")
    mf.append(1, {"a": 1.0})
    mf.append(2, {"a": 2.0})
    mf.append(2, {"val-core/x/reward/mean@1": 0.5, "a": 3.0})
    mf.append(3, {"a": 4.0})
    mf.close()
    assert lines(tmp_path / "m.jsonl") == [
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 3.0, "val-core/x/reward/mean@1": 0.5},
        {"step": 3, "a": 4.0},
    ]


def test_truncate_after_drops_later_steps_and_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s * 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    mf = MetricsFile(path)
    assert mf.truncate_after(3) == 3  # steps 4, 5 and the torn line
    mf.append(3, {"val": 1.0})  # e.g. validation before training resumes: merges into step 3
    mf.append(4, {"x": 40.0})
    mf.close()
    recs = lines(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[2] == {"step": 3, "x": 3.0, "val": 1.0} and recs[3]["x"] == 40.0


def test_reopen_after_crash_keeps_torn_line_separate(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    mf = MetricsFile(path)
    mf.append(2, {"x": 2.0})
    mf.close()
    assert read_metrics(path) == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_out_of_order_step_warns(tmp_path):
    mf = MetricsFile(tmp_path / "m.jsonl")
    mf.append(5, {"x": 1.0})
    with pytest.warns(UserWarning, match="truncate_after"):
        mf.append(2, {"x": 1.0})
    mf.close()


def test_truncate_on_missing_file_and_read_missing(tmp_path):
    mf = MetricsFile(tmp_path / "sub" / "m.jsonl")
    assert mf.truncate_after(0) == 0
    mf.close()
    assert read_metrics(tmp_path / "nope.jsonl") == []
