"""Rebuild this corpus from a checkout of verl: the trainer's key=value arguments of each example launch script.

    python tests/config/verl_scripts/extract.py /path/to/verl

Each `examples/**/*.sh` that starts `verl.trainer.main_ppo`, `main_ppo_sync` or the fully-async trainer is run by
bash inside bubblewrap (read-only root, no network) with `python`/`python3` replaced by a stub that writes its
arguments, and `ray`, `uv`, `wget`, `rm` and the like replaced by no-ops, so the shell resolves the script's own
variables, arrays and arithmetic. Unset variables the scripts require get placeholders (/data/...); DEVICE=gpu
(the scripts detect an NPU by importing torch_npu, which the stub would answer). A timestamp in a
value becomes `_DATE`. The files written here are facts about verl's scripts (key names and values), used as test data.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINERS = re.compile(r"verl\.(trainer\.main_ppo(_sync)?|experimental\.fully_async_policy\.fully_async_main)\b")
NOOPS = ("ray", "torchrun", "huggingface-cli", "hf", "wget", "curl", "pip", "pip3", "git",
         "modelscope", "mkdir", "ln", "rm", "cp", "mv", "tee", "sleep", "uv")
PLACEHOLDERS = {"HOME": "/home/user", "VERL_USE_UV": "0", "HDFS_ROOT": "/data", "RAY_DATA_HOME": "/data",
                "INFER_BACKEND": "vllm", "LORA_ADAPTER_PATH": "/data/adapter", "MODEL_PATH": "/data/model",
                "DATA_ROOT": "/data", "DEVICE": "gpu"}
STUB = """#!/bin/bash
for a in "$@"; do case "$a" in *main_ppo*|*fully_async_main*) hit=1;; esac; done
[ -n "$hit" ] && printf '%s\\0' "$@" > "$CAPTURE/args"
exit 0
"""


def capture(script: Path, root: Path, work: Path) -> list[str] | None:
    out = work / "capture"
    out.mkdir(exist_ok=True)
    (out / "args").unlink(missing_ok=True)
    env = {"PATH": f"{work / 'stubs'}:/usr/bin:/bin", "CAPTURE": str(out), "BASH_ENV": str(work / "env.sh"),
           **PLACEHOLDERS}
    cmd = ["bwrap", "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--ro-bind", str(work), str(work),
           "--bind", str(out), str(out), "--ro-bind", str(script.parent), str(script.parent), "--unshare-net",
           "--dev", "/dev", "--proc", "/proc", "--chdir", str(script.parent), "bash", str(script)]
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False)
    if not (out / "args").exists():
        return None
    args = (out / "args").read_bytes().decode().split("\0")[:-1]
    start = next(i for i, a in enumerate(args) if TRAINERS.search(a))
    args = [a.replace(str(root), "/verl") for a in args]              # the checkout's place is no fact
    return [re.sub(r"_?20\d{6}_\d{4}", "_DATE", a) for a in args[start + 1:]]


def main(verl: str) -> int:
    root = Path(verl).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "stubs").mkdir()
        for name in ("python", "python3"):
            (work / "stubs" / name).write_text(STUB)
        for name in NOOPS:
            (work / "stubs" / name).write_text("#!/bin/bash\nexit 0\n")
        for f in (work / "stubs").iterdir():
            f.chmod(0o755)
        (work / "env.sh").write_text("ulimit() { :; }\n")
        found = failed = 0
        for script in sorted(root.glob("examples/**/*.sh")):
            if not TRAINERS.search(script.read_text(errors="replace")):
                continue
            found += 1
            args = capture(script, root, work)
            name = str(script.relative_to(root / "examples")).removesuffix(".sh").replace(os.sep, "_")
            if args is None:
                failed += 1
                print(f"no trainer call captured: {script}", file=sys.stderr)
                continue
            (HERE / f"{name}.txt").write_text("".join(a + "\n" for a in args))
    print(f"{found - failed} of {found} scripts captured into {HERE}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
