"""The master process never imports torch (about 3.5 s and a few hundred MB): it builds
pool keys, tokenizes and schedules with torch-free modules only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mooncake.local.launcher import free_port

pytestmark = pytest.mark.cluster

# Runs the console entry point with a hook that records, at exit, which torch modules the
# process ever imported.
PROBE = (
    "import atexit, json, sys\n"
    "record, config = sys.argv[1:]\n"
    "def _record():\n"
    "    with open(record, 'w') as f:\n"
    "        json.dump(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'), f)\n"
    "atexit.register(_record)\n"
    "from mooncake.cli.app import main\n"
    "sys.argv = ['mooncake', 'up', '--role', 'master', '--config', config]\n"
    "main()\n"
)


def test_master_role_import_leaves_torch_out():
    code = "import sys, mooncake.roles.master.role; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_serving_master_never_imports_torch(tmp_path: Path):
    """Started, asked for status, metrics and a completion (refused: no nodes), stopped."""
    api_port = free_port()
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:llama3-8b"\n'
        f'[api]\nhost = "127.0.0.1"\nport = {api_port}\n[metrics]\nport = 0\n'
    )
    record = tmp_path / "torch_modules.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(record), str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline(), proc.stderr.read()  # the ready line
        base = f"http://127.0.0.1:{api_port}"
        for path in ("/v1/status", "/metrics", "/v1/models"):
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                assert resp.status == 200
        body = json.dumps({"model": "dummy:llama3-8b", "prompt": "hello", "max_tokens": 4})
        req = urllib.request.Request(
            base + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:  # no prefill or decode node
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code in (429, 503), refused.value.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads(record.read_text()) == []
