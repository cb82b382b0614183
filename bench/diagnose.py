"""`lathe diagnose --json` on this machine, kept with the device, date and commit (bench/results/diagnose_<device>.json).

    python bench/diagnose.py [--ray] [--git-sha SHA] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from lathe.cli.diagnose import run  # noqa: E402
from train import device_name, git_sha, slug  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ray", action="store_true", help="also join (or start) Ray and list its resources")
    p.add_argument("--git-sha", default=None, help="the commit measured, as your checkout names it")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    name = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    buf = io.StringIO()
    rc = run(as_json=True, ray=args.ray, out=buf)
    result = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": args.git_sha or git_sha(), "command": " ".join(sys.argv), "exit_code": rc,
              **json.loads(buf.getvalue())}
    out = Path(args.out or ROOT / "bench" / "results" / f"diagnose_{slug(name)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for c in result["checks"]:
        print(f"{c['status']:>4}  {c['name']}: {c['detail']}")
    print(f"exit code {rc}; wrote {out}")


if __name__ == "__main__":
    main()
