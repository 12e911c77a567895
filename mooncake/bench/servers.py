"""OpenAI-compatible servers started as child processes for a same-run comparison
(`mooncake bench vllm`): vLLM for CPU, `mooncake serve`, `mooncake up --local`.

Each `ServerSpec` is a command line, its environment and the URL it will answer on. A
`LaunchedServer` starts it in a session of its own (so all its processes can be ended by
its process group id), pinned to the CPUs given (the affinity is inherited by every
process it starts, so each server gets the same core budget), its output to a log file;
it is ready when `GET /v1/models` answers 200 (and its log shows `ready_text`, if any).
If the process exits first, or is not ready within the start-up timeout,
`ServerStartError` says so with the tail of its log. Stopping sends SIGTERM to the leader
(each server drains and stops its own children on it), waits, then SIGKILLs whatever is
left in its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mooncake.errors import MooncakeError

LOG_TAIL_LINES = 30


class ServerStartError(MooncakeError):
    """A server to compare against could not be started or never became ready."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server."""

    name: str  # vllm | serve | up-local | up-local-no-pool
    argv: list[str]
    url: str  # base URL, http://127.0.0.1:PORT
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    api_key: str = ""
    start_timeout_s: float = 600.0  # vLLM compiles and profiles at start-up
    # also wait for this line in its log: `up --local`'s API answers before its nodes join
    ready_text: str = ""
    stop_grace_s: float = 30.0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ("" when there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _pin(cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


class LaunchedServer:
    """One running server (a context manager: stopped on exit)."""

    def __init__(self, spec: ServerSpec, log_path: Path, cpus: frozenset[int] | None = None):
        self.spec, self.log_path, self.cpus = spec, log_path, cpus
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it answers; raises ServerStartError."""
        env = {**os.environ, **self.spec.env}
        env.pop("NOTIFY_SOCKET", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    self.spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=lambda: _pin(self.cpus),
                )
            except OSError as e:
                raise ServerStartError(
                    f"{self.spec.name}: cannot run {self.spec.argv[0]}: {e.strerror or e}"
                ) from e
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.start_timeout_s
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        with httpx.Client(timeout=5.0, headers=headers) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerStartError(self._failure(f"exited with status {code}"))
                if self._logged_ready():
                    with contextlib.suppress(httpx.HTTPError):  # not listening yet
                        if client.get(f"{self.spec.url}/v1/models").status_code == 200:
                            return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        self._failure(f"did not answer within {self.spec.start_timeout_s:g} s")
                    )
                time.sleep(0.5)

    def _logged_ready(self) -> bool:
        if not self.spec.ready_text:
            return True
        try:
            return self.spec.ready_text in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def _failure(self, what: str) -> str:
        tail = log_tail(self.log_path)
        shown = f"; the end of its log ({self.log_path}):\n{tail}" if tail else ""
        return f"{self.spec.name} ({' '.join(self.spec.argv[:4])} ...) {what}{shown}"

    def stop(self) -> None:
        """SIGTERM, wait up to the grace time, then SIGKILL its whole process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.spec.stop_grace_s)
        # NOTE: the group is this server's own session: nothing else is in it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def mooncake_argv(*args: str) -> list[str]:
    """A `mooncake` command line run with this interpreter."""
    return [sys.executable, "-m", "mooncake", *args]
