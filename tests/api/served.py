"""`mooncake serve` as a child process, for tests that talk to it over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def serve_process(workdir: Path, *args: str) -> Iterator[str]:
    """`mooncake serve ARGS` on 127.0.0.1, any port, metrics on the API port, one thread:
    its URL once it listens; on exit SIGTERM, and it must exit 0."""
    config = workdir / "serve.toml"
    config.write_text("[metrics]\nport = 0\n")
    cmd = [sys.executable, "-m", "mooncake", "serve", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--threads", "1", *args]
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield match.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
