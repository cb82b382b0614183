"""README.md's performance table is what bench/table.py makes of bench/results/: a result added or changed without
`python bench/table.py --write` fails here, and so does a table edited by hand."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "table.py"
_spec = importlib.util.spec_from_file_location("bench_table", TABLE)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def check(readme: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLE), "--check", "--readme", str(readme)], capture_output=True,
                          text=True, timeout=120)


def test_readme_table_matches_bench_results():
    done = check(ROOT / "README.md")
    assert done.returncode == 0, done.stderr


def test_a_table_edited_by_hand_is_stale(tmp_path):
    readme = (ROOT / "README.md").read_text()
    begin = readme.index("<!-- bench/table.py: begin")
    row = readme.index("\n| e2e |", begin) + 1
    edited = tmp_path / "README.md"
    edited.write_text(readme[:row] + readme[row:].replace("s/step", "s/step (hand-edited)", 1))
    done = check(edited)
    assert done.returncode == 1 and "stale" in done.stderr


def test_an_e2e_run_that_restates_the_benchs_checkpointing_is_its_default_workload():
    sys.path.insert(0, str(TABLE.parent))
    import table
    run = {"workload": {**table.E2E_WORKLOAD, "extra": []},
           "models": {"m": {"lathe_settings": {"checkpointing": False}, "lathe": {"step_s": 9.0, "phases_s": {}}}}}

    def rows(extra: list[str]) -> int:
        return len(list(table.e2e_rows({**run, "workload": {**run["workload"], "extra": extra}})))

    assert rows([]) == rows([table.CHECKPOINTING + "false"]) == 1
    assert rows([table.CHECKPOINTING + "true"]) == rows([table.CHECKPOINTING + "false", "trainer.x=1"]) == 0


def _fixed_load_run(**args) -> dict:
    """A bench/rollout.py result of one fixed-load row, its args the fixed load's with `args` on top."""
    return {"args": {"prompts": 256, "prompt_len": 256, "new_tokens": 512, **args},
            "models": {"1.5b": {"loads": {"fixed": {"lathe": {"tok_s": 1000.0}}}}}}


def test_rollout_rows_leave_out_a_fixed_load_of_other_sizes():
    """A long-context run through the fixed load (other prompt or response lengths) is not the fixed load's figure."""
    doc = _fixed_load_run
    assert len(list(table.rollout_rows(doc()))) == 1
    assert list(table.rollout_rows(doc(prompts=32, new_tokens=8192))) == []


def test_rollout_rows_leave_out_runs_whose_first_kv_cache_is_not_the_default():
    """`--kv-cache-dtype fp8` alone puts the FP8 cache's run in the `lathe` rows: not the engine's figure."""
    doc = _fixed_load_run
    assert len(list(table.rollout_rows(doc(kv_cache_dtype=["auto", "fp8"])))) == 1
    assert list(table.rollout_rows(doc(kv_cache_dtype=["fp8"]))) == []


def test_an_e2e_row_gives_the_update_mfu_of_the_measured_matmul_rate_too():
    """Derived from the datasheet MFU where an older results file has only that (790 TFLOP/s on an H200)."""
    sys.path.insert(0, str(TABLE.parent))
    import table
    run = {"device": "NVIDIA H200", "peak_bf16_tflops_datasheet": 989.4, "workload": {**table.E2E_WORKLOAD},
           "models": {"m": {"lathe": {"step_s": 9.0, "phases_s": {"update_actor": 4.0}, "update_mfu": 0.5}}}}
    (row,) = table.e2e_rows(run)
    assert "update MFU 50.0% of the datasheet peak, 62.6% of the measured matmul rate" in row[3]
    run["models"]["m"]["lathe"]["update_mfu_measured_rate"] = 0.6
    assert "60.0% of the measured matmul rate" in next(table.e2e_rows(run))[3]
