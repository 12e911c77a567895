"""Upstream Mooncake's own Python tests run against this package (`scripts/upstream-tests`).

    python -m mooncake.integrations.upstreamtests /path/to/Mooncake [--json] [--files ...]

Given a checkout of kvcache-ai/Mooncake (nothing is fetched), it starts our
`mooncake_master` as upstream's `scripts/run_tests.sh` starts theirs (`--default_kv_lease_ttl=500`,
RPC on 127.0.0.1:50051, which `test_buffer_pool_native.py` hard-codes) with its HTTP metadata
server, which run_tests.sh gives every test as `MC_METADATA_SERVER` (`--metadata p2p` gives
them "P2PHANDSHAKE" instead: then the initiator test cannot find its target, which upstream
too names by TARGET_SERVER_NAME only through a metadata service), sets the other variables
upstream's tests read (`MASTER_SERVER`, `DEFAULT_KV_LEASE_TTL`, `PROTOCOL`, `MC_FORCE_TCP`,
`TARGET_SERVER_NAME`, `INITIATOR_SERVER_NAME`, and our `MOONCAKE_CLUSTER_SECRET`; not
`LOCAL_HOSTNAME`, which run_tests.sh leaves to the tests' default "localhost"), starts
`transfer_engine_target.py` for the Transfer Engine's initiator test, and runs pytest on
each file of `mooncake-wheel/tests/` with our package first on the path (PYTHONPATH is the
folder holding this very `mooncake` package). Upstream's conftest.py is not loaded
(`--noconftest`): it would add upstream's own package folder to ours. Results come from
pytest's JUnit XML (a file this run writes), one outcome per test: passed, failed, error or
skipped. A file that tests upstream's own Python code rather than this package is skipped,
with the reason (`NOT_OURS`), unless the interpreter has what it imports.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder holding our `mooncake` package
TESTS_DIR = Path("mooncake-wheel") / "tests"
# the Store's and the Transfer Engine's tests, in upstream's run_tests.sh order where it has one
DEFAULT_FILES = (
    "test_import_structure.py",
    "transfer_engine_initiator_test.py",
    "test_distributed_object_store.py",
    "test_replicated_distributed_object_store.py",
    "test_batch_replica_clear.py",
    "test_buffer_pool_native.py",
    "test_put_get_tensor.py",
    "test_http_metadata_server.py",
)
# files that load upstream's own modules, not ours -> (module they need, why they are not ours)
NOT_OURS = {
    "test_http_metadata_server.py": (
        "aiohttp",
        "it puts upstream's mooncake-wheel/ first on sys.path and tests upstream's own "
        "aiohttp KVBootstrapServer (mooncake/http_metadata_server.py), which this package "
        "does not ship (ours: mooncake.engine.httpmeta); aiohttp is not installed here",
    ),
}
TARGET_SCRIPT = "transfer_engine_target.py"  # the initiator test's peer, run beside it
START_TIMEOUT_S = 60.0  # seconds our master or the target may take to be ready


@dataclass
class TestOutcome:
    file: str
    test: str  # class.name as pytest reports it
    outcome: str  # passed | failed | error | skipped
    message: str = ""  # first line of the failure or skip reason


def parse_junit(path: Path, file: str) -> list[TestOutcome]:
    """One outcome per <testcase> of a JUnit XML report pytest wrote."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}.{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = _first_line(node.get("message") or "")
                if message in ("", "collection failure"):  # the error is the text's last line
                    lines = [x for x in (node.text or "").splitlines() if x.strip()]
                    message = _first_line(lines[-1]) if lines else message
                break
        outcomes.append(TestOutcome(file, test.lstrip("."), outcome, message))
    return outcomes


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].removeprefix("E ").strip()[:300] if lines else ""


def summarize(outcomes: list[TestOutcome]) -> dict[str, int]:
    counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
    for o in outcomes:
        counts[o.outcome] += 1
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_line(proc: subprocess.Popen[str], marker: str, what: str) -> None:
    """Read `proc`'s stdout until a line holding `marker` (the child's ready handshake)."""
    assert proc.stdout is not None
    until = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < until:
        line = proc.stdout.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S:g} s")


def _stop(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Suite:
    """Our master (and the Transfer Engine target) for upstream's tests, and their runs."""

    def __init__(self, checkout: Path, python: str, master_port: int, metadata: str):
        self.tests = checkout / TESTS_DIR
        if not self.tests.is_dir():
            raise SystemExit(f"{checkout}: no {TESTS_DIR} here; give a checkout of Mooncake")
        self.python = python
        self.work = Path(tempfile.mkdtemp(prefix="mooncake-upstream-tests-"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        self.env.update(
            PYTHONPATH=str(REPO_ROOT),
            PYTHONUNBUFFERED="1",
            MOONCAKE_CLUSTER_SECRET=secrets.token_hex(16),
            MASTER_SERVER=f"127.0.0.1:{master_port}",
            DEFAULT_KV_LEASE_TTL="500",
            PROTOCOL="tcp",
            MC_FORCE_TCP="true",
            TARGET_SERVER_NAME=f"127.0.0.1:{_free_port()}",
            INITIATOR_SERVER_NAME=f"127.0.0.1:{_free_port()}",
        )
        self.master_port, self.metadata = master_port, metadata
        self.master: subprocess.Popen[str] | None = None

    def start_master(self) -> None:
        flags = [
            f"--port={self.master_port}",
            "--rpc_address=127.0.0.1",
            "--default_kv_lease_ttl=500",
            f"--metrics_port={_free_port()}",
            "--metrics_host=127.0.0.1",
        ]
        if self.metadata == "http":
            port = _free_port()
            flags += ["--enable_http_metadata_server", f"--http_metadata_server_port={port}"]
            self.env["MC_METADATA_SERVER"] = f"http://127.0.0.1:{port}/metadata"
        else:
            self.env["MC_METADATA_SERVER"] = "P2PHANDSHAKE"
        argv = [self.python, "-m", "mooncake.roles.master.upstream", *flags]
        log = (self.work / "master.log").open("w")
        self.master = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env
        )
        _wait_for_line(self.master, '"ready": true', f"our mooncake_master (log {log.name})")

    def run_file(self, name: str, timeout_s: float) -> list[TestOutcome]:
        path = self.tests / name
        if not path.exists():
            return [TestOutcome(name, "-", "error", "no such file in this checkout")]
        if name in NOT_OURS and not self._can_import(NOT_OURS[name][0]):
            return [TestOutcome(name, "-", "skipped", NOT_OURS[name][1])]
        target = self._start_target() if name == "transfer_engine_initiator_test.py" else None
        report = self.work / f"{path.stem}.xml"
        ini = self.work / "pytest.ini"
        ini.write_text("[pytest]\n")
        argv = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
        argv += ["-c", str(ini), "--rootdir", str(self.tests), f"--junitxml={report}", str(path)]
        log = self.work / f"{path.stem}.log"
        try:
            with log.open("w") as out:
                subprocess.run(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.tests,
                    timeout=timeout_s,
                )
        except subprocess.TimeoutExpired:
            return [TestOutcome(name, "-", "error", f"timed out after {timeout_s:g} s; see {log}")]
        finally:
            _stop(target)
        if not report.exists():
            return [TestOutcome(name, "-", "error", f"pytest wrote no report; see {log}")]
        return parse_junit(report, name) or [TestOutcome(name, "-", "error", f"no tests; {log}")]

    def _can_import(self, module: str) -> bool:
        argv = [self.python, "-c", f"import {module}"]
        return subprocess.run(argv, capture_output=True, env=self.env).returncode == 0

    def _start_target(self) -> subprocess.Popen[str] | None:
        argv = [self.python, str(self.tests / TARGET_SCRIPT)]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        try:
            _wait_for_line(proc, "Target server ready", TARGET_SCRIPT)
        except RuntimeError:
            _stop(proc)
            return None  # NOTE: the initiator's tests then fail and say why
        return proc

    def close(self) -> None:
        _stop(self.master)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("checkout", type=Path, help="a checkout of kvcache-ai/Mooncake")
    p.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="test files to run")
    p.add_argument("--python", default=sys.executable, help="interpreter with our package")
    p.add_argument("--master-port", type=int, default=50051, help="our master's RPC port")
    p.add_argument(
        "--metadata",
        choices=("p2p", "http"),
        default="http",
        help="the tests' MC_METADATA_SERVER: our master's HTTP metadata server (as upstream's "
        "run_tests.sh gives them), or P2PHANDSHAKE",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per test file")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    args = p.parse_args(argv)
    suite = Suite(args.checkout.resolve(), args.python, args.master_port, args.metadata)
    outcomes: list[TestOutcome] = []
    try:
        suite.start_master()
        for name in args.files:
            outcomes += suite.run_file(name, args.timeout)
    finally:
        suite.close()
    counts = summarize(outcomes)
    if args.json:
        print(json.dumps({"summary": counts, "tests": [asdict(o) for o in outcomes]}, indent=2))
    else:
        for o in outcomes:
            print(f"{o.outcome:8} {o.file}::{o.test}" + (f"  ({o.message})" if o.message else ""))
        print(
            " ".join(f"{k}={v}" for k, v in counts.items())
            + f"  (package {REPO_ROOT}; logs in {suite.work})"
        )
    return 0 if counts["failed"] == counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
