"""README.md's performance table is what bench/table.py makes of bench/results/: a result added or changed without
`python bench/table.py --write` fails here, and so does a table edited by hand."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "table.py"


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
