"""`bench dropin`: the same small workload through upstream's Python API, on this package
and on upstream's wheel, in one run.

    side = run_side(SideSpec.ours(), duration_s=1.0)          # -> SideResult
    side = run_side(SideSpec.upstream(python), duration_s=1.0)
    rows = compare(ours, upstream)                             # -> list[DropinRow]

Each side is four processes on 127.0.0.1 started by that side's interpreter: its
`mooncake_master` (ours: `mooncake.roles.master.upstream` with the same flags), a store node
with a segment, a Transfer Engine target, and a client that runs dropin_driver.py's cells.
Upstream's side names its Store's metadata by its master's HTTP metadata server, ours by
P2PHANDSHAKE (the Transfer Engine uses P2PHANDSHAKE on both). Every reply line is parsed
strictly; a side that fails says why in its `error` and the other side still reports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from mooncake.bench.upstream import (
    START_TIMEOUT_S,
    _Child,
    _clean_env,
    _free_port,
    _master_flags,
    _wait_listening,
    probe,
)
from mooncake.errors import StoreError

DRIVER = Path(__file__).with_name("dropin_driver.py")
REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder holding our `mooncake` package
NUM_PHASES = 7  # reply lines of a client: 3 cells x (put, get) + the write
SLACK_S = 60.0  # seconds a client may take beyond its timed phases

Figure = Annotated[float, msgspec.Meta(ge=0.0)]


class Phase(msgspec.Struct, forbid_unknown_fields=True):
    """One reply line of the client driver: one op of one cell."""

    cell: str
    op: str
    bytes_per_call: Annotated[int, msgspec.Meta(ge=1)]
    calls: Annotated[int, msgspec.Meta(ge=1)]
    gbps: Figure  # GB/s (1e9 bytes) over the summed call time
    p50_us: Figure  # median call, microseconds


class _Failure(msgspec.Struct, forbid_unknown_fields=True):
    error: str


def parse_phase(line: bytes) -> Phase:
    """A reply line as a Phase; StoreError for an error reply or a malformed line."""
    try:
        raw = msgspec.json.decode(line)
        if isinstance(raw, dict) and "error" in raw:
            raise StoreError(msgspec.convert(raw, _Failure).error)
        return msgspec.convert(raw, Phase)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        text = line.decode(errors="replace").strip()[:200]
        raise StoreError(f"dropin client driver: bad reply {text!r}: {e}") from e


@dataclass
class SideSpec:
    """How to start one side: its interpreter, environment, master command and metadata."""

    name: str  # "ours" or "upstream"
    python: str
    env: dict[str, str]
    master_argv: list[str]  # without the flags
    metadata: str  # the Store's metadata_server; "http" = its master's HTTP metadata server

    @staticmethod
    def ours() -> SideSpec:
        env = _clean_env()
        env["PYTHONPATH"] = str(REPO_ROOT)
        env["MOONCAKE_CLUSTER_SECRET"] = secrets.token_hex(16)
        master = [sys.executable, "-m", "mooncake.roles.master.upstream"]
        return SideSpec("ours", sys.executable, env, master, "P2PHANDSHAKE")

    @staticmethod
    def upstream(python: str) -> SideSpec:
        env, master_bin = probe(python)
        return SideSpec("upstream", python, env, [str(master_bin)], "http")


@dataclass
class SideResult:
    name: str
    phases: list[Phase] = field(default_factory=list)
    error: str = ""  # why the side did not finish ("" = it did)


def master_flags(spec: SideSpec, rpc_port: int, metadata_port: int) -> list[str]:
    """Upstream's flags for the bench's master; ours serves no HTTP metadata (P2PHANDSHAKE)."""
    flags = _master_flags(rpc_port, metadata_port)
    if spec.metadata != "http":
        flags = [f for f in flags if "metadata_server" not in f]
    return flags


def run_side(
    spec: SideSpec, duration_s: float, warmup_s: float = 1.0, segment_bytes: int = 512 << 20
) -> SideResult:
    """The workload on one side; the figures, or the reason it stopped (never raises a
    StoreError: the other side still runs)."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"mooncake-dropin-{spec.name}-"))
    children: list[_Child] = []
    result = SideResult(spec.name)
    rpc, meta = _free_port(), _free_port()
    metadata = f"http://127.0.0.1:{meta}/metadata" if spec.metadata == "http" else spec.metadata
    driver = [spec.python, "-P", str(DRIVER)]
    where = ["--master", f"127.0.0.1:{rpc}", "--metadata", metadata]
    try:
        master_argv = [*spec.master_argv, *master_flags(spec, rpc, meta)]
        master = _Child("master", master_argv, spec.env, log_dir, spec.name)
        children.append(master)
        _wait_listening(master, [rpc, meta] if spec.metadata == "http" else [rpc])
        node_argv = [*driver, "node", *where, "--segment-bytes", str(segment_bytes)]
        node = _Child("node", node_argv, spec.env, log_dir, spec.name)
        children.append(node)
        node.wait_ready()
        target = _Child("target", [*driver, "target"], spec.env, log_dir, spec.name)
        children.append(target)
        line = target.read_line(START_TIMEOUT_S)
        try:
            peer = json.loads(line)
            dest = ["--target", str(peer["peer"]), "--target-addr", str(int(peer["addr"]))]
        except (ValueError, KeyError, TypeError) as e:
            raise target.fail(f"expected its peer name and address, got {line[:200]!r}") from e
        timing = ["--duration", str(duration_s), "--warmup", str(warmup_s)]
        client_argv = [*driver, "client", *where, *dest, *timing]
        client = _Child("client", client_argv, spec.env, log_dir, spec.name)
        children.append(client)
        timeout = START_TIMEOUT_S + warmup_s + NUM_PHASES * 2 * duration_s + SLACK_S
        for _ in range(NUM_PHASES):
            result.phases.append(parse_phase(client.read_line(timeout)))
    except StoreError as e:
        result.error = f"{e} (logs in {log_dir})"
    finally:
        for child in reversed(children):
            child.stop(on_eof=child.name != "master")
    if not result.error:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


class DropinRow(msgspec.Struct):
    """One op of one cell, both sides; None where a side has no figure."""

    cell: str
    op: str
    ours_gbps: float | None
    upstream_gbps: float | None
    ratio: float | None  # ours / upstream GB/s
    ours_p50_us: float | None
    upstream_p50_us: float | None


def compare(ours: SideResult, upstream: SideResult) -> list[DropinRow]:
    """Rows in the driver's order (whichever side has figures), ours against upstream's."""
    mine = {(p.cell, p.op): p for p in ours.phases}
    theirs = {(p.cell, p.op): p for p in upstream.phases}
    order = [*(k for k in theirs), *(k for k in mine if k not in theirs)]
    rows = []
    for cell, op in order:
        a, b = mine.get((cell, op)), theirs.get((cell, op))
        ratio = a.gbps / b.gbps if a is not None and b is not None and b.gbps > 0 else None
        rows.append(
            DropinRow(
                cell,
                op,
                a.gbps if a else None,
                b.gbps if b else None,
                round(ratio, 3) if ratio is not None else None,
                a.p50_us if a else None,
                b.p50_us if b else None,
            )
        )
    return rows


def ours_available() -> str:
    """What this package lacks of the upstream API names the driver uses ("" = nothing)."""
    for module, name in (
        ("mooncake.store", "MooncakeDistributedStore"),
        ("mooncake.engine", "TransferEngine"),
    ):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is missing"
            if not hasattr(importlib.import_module(module), name):
                return f"{module}.{name} is missing"
        except ImportError as e:
            return f"{module}: {e}"
    return ""
