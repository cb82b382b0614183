"""The local code sandbox against an attack suite: each attack scores 0 and leaves the host as it was; right and
wrong programs score 1 and 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from lathe.reward import sandbox
from lathe.reward.code import compute_score
from lathe.reward.sandbox import SandboxLimits, run_python

WHY = sandbox.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"local sandbox unavailable: {WHY}")
LIMITS = SandboxLimits(time_limit_s=2, memory_limit_mb=256, max_output_bytes=1 << 16, max_processes=32)
ECHO = json.dumps({"inputs": ["hello\n"], "outputs": ["hello\n"]})


def nobody_processes(wait_s: float = 3.0) -> list[str]:
    """Live (not zombie) processes of the sandbox's user, after giving exiting namespaces `wait_s` to go."""
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(["ps", "-u", str(sandbox.NOBODY), "-o", "pid=,stat=,comm="], capture_output=True,
                             text=True)
        live = [line for line in out.stdout.splitlines() if line.split()[1][0] != "Z"]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.05)


def score(program: str) -> float:
    sandbox.configure(**vars(LIMITS))
    return compute_score(f"```python\n{program}\n```", ECHO)


@pytest.fixture(autouse=True)
def host_unchanged():
    before = set(os.listdir("/tmp"))
    yield
    assert nobody_processes() == [], "a sandboxed process outlived its run"
    leftovers = {p for p in set(os.listdir("/tmp")) - before if p.startswith("lathe-sbx-")}
    assert not leftovers, leftovers


def test_right_and_wrong_programs():
    assert score("print(input())") == 1.0
    assert score("print(input()[::-1])") == 0.0
    assert score("raise SystemExit(3)") == 0.0


ATTACKS = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "infinite loop": "while True:\n    pass",
    "memory bomb": "x = bytearray(8 << 30)\nprint(input())",
    "1 GB print": "import sys\nchunk = 'x' * 65536\nfor _ in range(16384):\n    sys.stdout.write(chunk)",
    "child outlives parent": "import subprocess\nsubprocess.Popen(['sleep', '60'])\nprint(input()[::-1])",
    "daemon via fork": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('x')",
}


@pytest.mark.parametrize("name", ATTACKS)
def test_attacks_score_zero(name):
    start = time.monotonic()
    assert score(ATTACKS[name]) == 0.0
    assert time.monotonic() - start < LIMITS.time_limit_s + 5


def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    for host in ("127.0.0.1", "1.1.1.1"):
        r = run_python(f"import socket\nsocket.create_connection(('{host}', {port if host == '127.0.0.1' else 80}), timeout=2)\nprint('connected')", limits=LIMITS)
        assert r.status == "error" and "connected" not in r.stdout
    time.sleep(0.2)
    assert accepted == []
    server.close()


def test_no_writes_or_deletes_outside_and_no_host_secrets(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    monkeypatch.setenv("LATHE_TEST_SECRET", "s3cr3t")
    program = f"""
import os
for target in ({str(victim)!r}, '/usr/lathe_owned', '/etc/lathe_owned', {str(tmp_path / 'new.txt')!r}):
    try:
        open(target, 'w').write('owned')
        print('WROTE', target)
    except OSError:
        pass
try:
    os.remove({str(victim)!r})
    print('DELETED')
except OSError:
    pass
print(sorted(os.environ))
print(os.path.exists('/root'), os.path.exists({str(tmp_path)!r}))
"""
    r = run_python(program, limits=LIMITS)
    assert r.status == "ok", r.stderr
    assert "WROTE" not in r.stdout and "DELETED" not in r.stdout and "s3cr3t" not in r.stdout
    assert "LATHE_TEST_SECRET" not in r.stdout and "False False" in r.stdout
    assert victim.read_text() == "keep me" and not (tmp_path / "new.txt").exists()
    assert not os.path.exists("/usr/lathe_owned") and not os.path.exists("/etc/lathe_owned")


def test_limits_report_how_a_run_ended():
    assert run_python("while True: pass", limits=LIMITS).status == "timeout"
    assert run_python("import sys\nwhile True: sys.stdout.write('x' * 65536)", limits=LIMITS).status == "output_limit"
    assert run_python("x = bytearray(8 << 30)", limits=LIMITS).status == "error"


def test_concurrent_runs_share_the_slots():
    limits = SandboxLimits(**{**vars(LIMITS), "max_concurrent": 1})
    results = []
    threads = [threading.Thread(target=lambda: results.append(run_python("import time; time.sleep(0.3)",
                                                                         limits=limits)))
               for _ in range(3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status == "ok" for r in results) and time.monotonic() - start >= 0.85      # one at a time


def test_a_sandbox_fusion_service_url_is_used_instead(monkeypatch):
    """`sandbox_fusion.url`: the run_code request goes to the service; an outage raises (counted, not scored 0)."""
    import http.server

    seen = []

    class Service(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = body["stdin"] if "input()" in body["code"] else ""
            answer = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": out,
                                                          "stderr": ""}}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    limits = SandboxLimits(**{**vars(LIMITS), "url": url})
    assert run_python("print(input())", "hi\n", limits=limits).stdout == "hi\n"
    assert seen[0]["language"] == "python" and seen[0]["memory_limit_MB"] == LIMITS.memory_limit_mb
    server.shutdown()
    server.server_close()
    with pytest.raises(sandbox.SandboxUnavailable, match="sandbox_fusion.url"):
        run_python("print(1)", limits=limits)
