"""Upstream Mooncake's C++ Store on loopback: the same-run baseline of `mooncake bench store`.

    with UpstreamStore("/path/.venv-upstream/bin/python", pool_bytes=512 << 20) as up:
        cell = up.run("bytes", 4096, duration_s=1.5)  # -> UpstreamCell

Three child processes of an upstream interpreter (scripts/upstream-venv makes one from
PyPI): upstream's mooncake_master, a store node with a segment of `pool_bytes`, and a
client with none, the latter two running upstream_driver.py. Upstream's package is also
named `mooncake`, hence separate interpreters. Each child's stderr (glog) goes to a log
file in a temporary folder that every error names; every reply line is parsed strictly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Annotated, Self

import msgspec

from mooncake.bench.store import keys_per_call
from mooncake.bench.storeload import ClientFigures, parse_figures
from mooncake.errors import StoreError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0  # seconds a child may take to be ready
STOP_TIMEOUT_S = 10.0  # seconds a child may take to exit once its stdin is closed
REPLY_SLACK_S = 60.0  # seconds a cell's reply may take beyond its warm-up and phases
MAX_LINE_BYTES = 1 << 16  # a longer reply line is refused
DRIVER = Path(__file__).with_name("upstream_driver.py")
LEASE_MS = 200  # the master's read lease: the bench's (LocalCluster's 0.2 s)

Figure = Annotated[float, msgspec.Meta(ge=0.0)]
Calls = Annotated[int, msgspec.Meta(ge=1)]


class UpstreamCell(msgspec.Struct, forbid_unknown_fields=True):
    """Upstream's figures of one cell (one reply line of the client driver); units as in
    StoreBenchRow."""

    api: str
    value_bytes: int  # bytes per value
    keys_per_call: int
    put_gbps: Figure  # GB/s (1e9 bytes) of values over summed put call time
    get_gbps: Figure
    put_p50_us: Figure  # per-call latency percentiles, microseconds
    put_p99_us: Figure
    get_p50_us: Figure
    get_p99_us: Figure
    num_puts: Calls  # calls measured
    num_gets: Calls


class _Failure(msgspec.Struct, forbid_unknown_fields=True):
    error: str  # the driver's own account of what failed


def parse_reply(line: bytes, api: str, size: int, keys_per_call: int) -> UpstreamCell:
    """The client driver's reply to a request for (api, size) as a cell; StoreError for an
    error reply, a malformed line or figures of another cell."""
    text = line.decode(errors="replace").strip()
    try:
        raw = msgspec.json.decode(line)
        if isinstance(raw, dict) and "error" in raw:
            failure = msgspec.convert(raw, _Failure)
            raise StoreError(f"upstream {api} {size} B: {failure.error}")
        cell = msgspec.convert(raw, UpstreamCell)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StoreError(f"upstream client driver: bad reply {text[:200]!r}: {e}") from e
    got = (cell.api, cell.value_bytes, cell.keys_per_call)
    if got != (api, size, keys_per_call):
        raise StoreError(
            f"upstream client driver answered for {got}, asked for {(api, size, keys_per_call)}"
        )
    return cell


def probe(python: str) -> tuple[dict[str, str], Path]:
    """The environment (LD_LIBRARY_PATH with the CUDA runtime upstream's store.so links)
    and the mooncake_master path for `python`; StoreError if it lacks upstream's Store."""
    hint = "create one with scripts/upstream-venv and pass its bin/python to --upstream"
    find = "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"
    try:
        out = subprocess.run(
            [python, "-P", "-c", find],
            capture_output=True,
            timeout=30,
            check=True,
            env=_clean_env(),
        )
        paths = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        said = getattr(e, "stderr", None) or b""
        why = (said.decode(errors="replace").strip().splitlines() or [str(e)])[-1]
        raise StoreError(
            f"--upstream {python!r} is not a Python >= 3.11 that runs ({why}); {hint}"
        ) from e
    env = _clean_env()
    cudart = Path(paths["purelib"]) / "nvidia" / "cuda_runtime" / "lib"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(cudart), env.get("LD_LIBRARY_PATH", "")) if p
    )
    # NOTE: our package has a MooncakeDistributedStore too (store/upstream/): upstream's is
    # the class of its C++ extension module mooncake/store.so
    check = (
        "import mooncake.store as m; from mooncake.store import MooncakeDistributedStore; "
        "import sys; sys.exit(0 if m.__file__.endswith('.so') else 'MooncakeDistributedStore "
        "here is not upstream C++ one but ' + m.__file__)"
    )
    res = subprocess.run([python, "-P", "-c", check], capture_output=True, timeout=60, env=env)
    if res.returncode != 0:
        last = (res.stderr.decode(errors="replace").strip().splitlines() or ["(no output)"])[-1]
        raise StoreError(
            f"--upstream {python!r} cannot import upstream Mooncake's Store "
            f"(mooncake.store.MooncakeDistributedStore): {last}; {hint}"
        )
    master = Path(paths["scripts"]) / "mooncake_master"
    if not master.exists():
        raise StoreError(f"--upstream {python!r} has no {master}; {hint}")
    return env, master


def _clean_env() -> dict[str, str]:
    # NOTE: PYTHONPATH could put our package (also `mooncake`) before upstream's
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Child:
    """One upstream process; stdin a pipe (EOF stops it), stderr its log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_dir: Path,
        side: str = "upstream",  # whose process, in errors (bench dropin runs ours too)
    ):
        self.name, self.side, self.log = name, side, log_dir / f"{name}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=log_dir,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        self.buf = b""

    def fail(self, what: str) -> StoreError:
        code = self.proc.poll()
        gone = f" (exited with {code})" if code is not None else ""
        return StoreError(f"{self.side} {self.name}{gone}: {what}; see {self.log}")

    def read_line(self, timeout_s: float) -> bytes:
        """The next line on the child's stdout (no newline); StoreError past the timeout,
        at EOF or past MAX_LINE_BYTES."""
        until = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE_BYTES:
                raise self.fail(f"a reply line longer than {MAX_LINE_BYTES} bytes")
            left = until - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise self.fail(f"no reply within {timeout_s:g} s")
            chunk = os.read(self.fd, MAX_LINE_BYTES)
            if not chunk:
                raise self.fail("its output ended")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def wait_ready(self) -> None:
        line = self.read_line(START_TIMEOUT_S)
        if line.strip() != b"READY":
            raise self.fail(f"expected READY, got {line[:200]!r}")

    def stop(self, on_eof: bool) -> None:
        """Close stdin (the drivers then close their Store and exit); SIGTERM when the
        child does not stop on EOF (the master) or has not exited within STOP_TIMEOUT_S;
        SIGKILL after another STOP_TIMEOUT_S."""
        with contextlib.suppress(OSError):
            self.stdin.close()
        steps = [self.proc.terminate, self.proc.kill]
        for step in [lambda: None, *steps] if on_eof else steps:
            step()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
                break
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _wait_listening(child: _Child, ports: list[int]) -> None:
    """Poll until each port accepts (the master has no ready line of its own)."""
    until = time.monotonic() + START_TIMEOUT_S
    for port in ports:
        while True:
            if child.proc.poll() is not None:
                raise child.fail("exited while starting")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > until:
                raise child.fail(f"port {port} not accepting after {START_TIMEOUT_S:g} s")
            time.sleep(0.05)


def _master_flags(rpc_port: int, metadata_port: int) -> list[str]:
    """mooncake_master on 127.0.0.1 with its HTTP metadata server, the bench's read lease,
    no periodic metric lines, and its metrics server on a free port (not 9003: no clash)."""
    return [
        f"--rpc_port={rpc_port}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={metadata_port}",
        "--http_metadata_server_host=127.0.0.1",
        f"--default_kv_lease_ttl={LEASE_MS}",
        f"--metrics_port={_free_port()}",
        "--metrics_host=127.0.0.1",
        "--enable_metric_reporting=false",
    ]


def start_pool(
    python: str,
    env: dict[str, str],
    master_bin: Path,
    pool_bytes: int,
    log_dir: Path,
    children: list[_Child],
    clients: list[list[str]],  # per client driver: its mode and arguments ([] = "client")
) -> None:
    """Start upstream's master, a store node of `pool_bytes` and one driver per `clients`
    entry, appending each to `children` as it starts (the caller stops them on failure)."""
    rpc, meta = _free_port(), _free_port()
    master = _Child("master", [str(master_bin), *_master_flags(rpc, meta)], env, log_dir)
    children.append(master)
    _wait_listening(master, [rpc, meta])
    where = ["--master", f"127.0.0.1:{rpc}", "--metadata", f"http://127.0.0.1:{meta}/metadata"]
    driver = [python, "-P", str(DRIVER)]
    node = _Child(
        "node", [*driver, "node", *where, "--segment-bytes", str(pool_bytes)], env, log_dir
    )
    children.append(node)
    node.wait_ready()
    started = []
    for i, args in enumerate(clients):
        name = "client" if len(clients) == 1 else f"client-{i}"
        started.append(_Child(name, [*driver, *(args or ["client"]), *where], env, log_dir))
        children.append(started[-1])
    for child in started:  # NOTE: started together: N clients' setups overlap
        child.wait_ready()


def stop_children(children: list[_Child]) -> None:
    """Stop the drivers (all at once), then the master."""
    for child in children:
        if child.name != "master":
            with contextlib.suppress(OSError):
                child.stdin.close()
    for child in reversed(children):
        child.stop(on_eof=child.name != "master")


class _UpstreamPool:
    """Upstream's master, a store node and `drivers` (upstream_driver.py argument lists),
    all on 127.0.0.1, with their logs kept in a temporary folder when anything failed."""

    def __init__(self, python: str, pool_bytes: int, prefix: str, drivers: list[list[str]]):
        env, master_bin = probe(python)
        self.log_dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.children: list[_Child] = []
        self.failed = False
        try:
            start_pool(python, env, master_bin, pool_bytes, self.log_dir, self.children, drivers)
        except BaseException:
            self.failed = True
            self.close()
            raise

    def close(self) -> None:
        """Stop the drivers and the node (both at once), then the master; the logs are kept
        if anything failed."""
        stop_children(self.children)
        self.children = []
        if self.failed:
            log.warning("upstream Mooncake's logs are kept in %s", self.log_dir)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UpstreamStore(_UpstreamPool):
    """Upstream's master, a store node with a `pool_bytes` segment and a client, all on
    127.0.0.1; `run` measures one cell in the client."""

    def __init__(self, python: str, pool_bytes: int):
        super().__init__(python, pool_bytes, "mooncake-upstream-", [[]])
        self.client = self.children[-1]

    def run(self, api: str, size: int, duration_s: float, warmup_s: float = 0.0) -> UpstreamCell:
        """Measure one cell (after `warmup_s` of untimed 4 KiB puts and gets when > 0), as
        StoreBench.run measures ours."""
        per_call = keys_per_call(api, size)
        req = {"api": api, "size": size, "duration": duration_s, "warmup": warmup_s}
        try:
            self.client.stdin.write(json.dumps(req).encode() + b"\n")
            self.client.stdin.flush()
        except OSError as e:
            self.failed = True
            raise self.client.fail(f"cannot send a request ({e})") from e
        timeout = warmup_s + 2 * duration_s + REPLY_SLACK_S
        try:
            return parse_reply(self.client.read_line(timeout), api, size, per_call)
        except StoreError as e:
            self.failed = True
            raise StoreError(f"{e} (logs in {self.log_dir})") from e


class UpstreamLoad(_UpstreamPool):
    """Upstream's master and store node with `num_clients` load drivers (upstream_driver.py
    `load`), for `bench store --clients`; `run` measures them all at once."""

    def __init__(self, python: str, pool_bytes: int, num_clients: int):
        loads = [["load", "--index", str(i)] for i in range(num_clients)]
        super().__init__(python, pool_bytes, "mooncake-upstream-load-", loads)
        self.clients = self.children[2:]

    def _ask(self, req: dict[str, object], timeout_s: float) -> list[bytes]:
        line = json.dumps(req).encode() + b"\n"
        try:
            for c in self.clients:
                c.stdin.write(line)
                c.stdin.flush()
            return [c.read_line(timeout_s) for c in self.clients]
        except (OSError, StoreError) as e:
            self.failed = True
            raise StoreError(f"upstream load clients: {e} (logs in {self.log_dir})") from e

    def run(self, value_bytes: int, duration_s: float) -> list[ClientFigures]:
        """Every driver pre-fills, then all run `duration_s` together; their figures."""
        ready = self._ask({"cmd": "prepare", "size": value_bytes}, START_TIMEOUT_S * 4)
        if bad := [r for r in ready if r.strip() != b"ready"]:
            self.failed = True
            raise StoreError(f"upstream load client: {bad[0][:300]!r} (logs in {self.log_dir})")
        replies = self._ask({"cmd": "go", "duration": duration_s}, duration_s + REPLY_SLACK_S)
        try:
            return [parse_figures(r) for r in replies]
        except StoreError as e:
            self.failed = True
            raise StoreError(f"upstream {e} (logs in {self.log_dir})") from e
