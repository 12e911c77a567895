"""`python -m mooncake.hw.nicbench` (`scripts/hwtest`'s "nic bench" step): the Transfer
Engine's RDMA path against perftest on the same NICs, with a pass threshold.

For each active RDMA NIC and each op (write, read), 1 MiB messages for `--duration` seconds:

    perftest   ib_write_bw / ib_read_bw on that NIC: server and client here, through the
               NIC (loopback), or the client against `--peer HOST`, where the operator runs
               `ib_write_bw -d NIC` and `ib_read_bw -d NIC` servers (one per run, in order)
    mooncake   `mooncake bench transfer --protocol rdma --op OP --block-size 1MiB --nics NIC`,
               its target here (`--local`) or the peer's (`--peer HOST --peer-port PORT
               --secret S`, where the peer runs `mooncake bench transfer --mode target
               --protocol rdma --port PORT --secret S`)
    ratio      mooncake GB/s / perftest GB/s; the row passes at >= `--threshold` (0.9, the
               Transfer Engine issue's target)

then every NIC at once: mooncake over all of them against the sum of their perftest figures
(the aggregate). Prints one JSON document; exits 1 when a row failed, 0 otherwise (also
when there is nothing to measure: no active NIC, or no perftest, each said in "skipped").
Two hosts exercise routed RoCEv2, which one host's loopback never does; `--gid-index`
passes perftest the GID the Transfer Engine picks (RoCEv2, IPv4-mapped) when its default
differs.

Has not run on an RDMA NIC: the figures come from hardware runs, the parsing and the
verdict are tested here (tests/hw/test_nicbench.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

DEFAULT_THRESHOLD = 0.9
MESSAGE_BYTES = 1 << 20
TOOLS = {"write": "ib_write_bw", "read": "ib_read_bw"}

# (op, nic) -> GB/s, or raises RuntimeError saying why it could not measure
Measure = Callable[[str, str], float]


@dataclass
class Row:
    """One NIC (or "all") and op: both figures and the verdict."""

    nic: str
    op: str
    perftest_GBps: float | None
    mooncake_GBps: float | None
    ratio: float | None
    passed: bool
    error: str = ""


def parse_perftest(output: str) -> float:
    """GB/s of a perftest bandwidth run: the "BW average" column of its result row, in
    Gb/sec (`--report_gbits`) or MB/sec (perftest's MB: 2^20 bytes). Raises ValueError
    when the output has no result row."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "BW average" not in line:
            continue
        header = [h for h in re.split(r"\s{2,}", line.strip()) if h]
        col = next(j for j, h in enumerate(header) if h.startswith("BW average"))
        unit = header[col]
        for row in lines[i + 1 :]:
            fields = row.split()
            if len(fields) == len(header) and fields[0].isdigit():
                value = float(fields[col])
                if "Gb/sec" in unit:
                    return value / 8
                if "MB/sec" in unit:
                    return value * (1 << 20) / 1e9
                raise ValueError(f"perftest: unknown bandwidth unit {unit!r}")
    raise ValueError("perftest printed no bandwidth result row")


def judge(
    nics: Sequence[str], ops: Sequence[str], perftest: Measure, mooncake: Measure, threshold: float
) -> list[Row]:
    """A row per NIC and op, then one per op over every NIC ("all": the mooncake figure
    over all NICs at once against the sum of their perftest figures)."""
    rows: list[Row] = []
    for op in ops:
        base: dict[str, float] = {}
        for nic in nics:
            rows.append(
                _row(nic, op, partial(perftest, op, nic), partial(mooncake, op, nic), threshold)
            )
            if rows[-1].perftest_GBps is not None:
                base[nic] = rows[-1].perftest_GBps
        if len(nics) > 1:
            total = sum(base.values()) if len(base) == len(nics) else None
            every = partial(mooncake, op, ",".join(nics))
            rows.append(_row("all", op, partial(_given, total), every, threshold))
    return rows


def _given(value: float | None) -> float:
    if value is None:
        raise RuntimeError("a NIC's perftest figure is missing")
    return value


def _row(
    nic: str, op: str, perftest: Callable[[], float], ours: Callable[[], float], threshold: float
) -> Row:
    errors: list[str] = []
    figures: list[float | None] = []
    for what, fn in (("perftest", perftest), ("mooncake", ours)):
        try:
            figures.append(fn())
        except (RuntimeError, ValueError) as e:
            errors.append(f"{what}: {e}")
            figures.append(None)
    base, got = figures
    ratio = got / base if got is not None and base else None
    passed = ratio is not None and ratio >= threshold
    return Row(nic, op, base, got, ratio, passed, "; ".join(errors))


def _run(cmd: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd[:3])} ran past {timeout_s:g} s") from e
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {done.returncode}: {' | '.join(tail)}")
    return done.stdout


def perftest_measure(duration_s: float, peer: str, gid_index: int | None) -> Measure:
    """The perftest figure of one NIC: loopback through it, or against `peer`'s server."""

    def measure(op: str, nic: str) -> float:
        args = [TOOLS[op], "-d", nic, "-s", str(MESSAGE_BYTES), "-D", f"{duration_s:g}"]
        args += ["-F", "--report_gbits"]
        if gid_index is not None:
            args += ["-x", str(gid_index)]
        if peer:
            return parse_perftest(_run([*args, peer], duration_s + 30))
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # NOTE: perftest's server has no ready signal; it listens at once
            return parse_perftest(_run([*args, "127.0.0.1"], duration_s + 30))
        finally:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    return measure


def mooncake_measure(duration_s: float, peer: str, peer_port: int, secret: str) -> Measure:
    """The Transfer Engine's figure on NICs `nics` (comma-separated)."""

    def measure(op: str, nics: str) -> float:
        cmd = [sys.executable, "-m", "mooncake", "bench", "transfer", "--protocol", "rdma"]
        cmd += ["--op", op, "--block-size", "1MiB", "--duration", f"{duration_s:g}"]
        cmd += ["--nics", nics, "--no-baseline", "--json"]
        cmd += ["--target", f"{peer}:{peer_port}", "--secret", secret] if peer else ["--local"]
        result = json.loads(_run(cmd, duration_s + 120))
        if result.get("protocol") != "rdma":
            raise RuntimeError(f"the bench moved its bytes over {result.get('protocol')!r}")
        return float(result["gbps"])

    return measure


def active_nics(sysfs_root: Path | None = None) -> list[str]:
    """Names of the RDMA devices with an ACTIVE port."""
    from mooncake.native import sysfs

    nics = sysfs.read_rdma_nics(sysfs_root) if sysfs_root else sysfs.read_rdma_nics()
    return [n.name for n in nics or [] if n.is_active]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--nics", default="", help="comma-separated; default every active one")
    ap.add_argument("--peer", default="", help="HOST running the perftest and bench targets")
    ap.add_argument("--peer-port", type=int, default=7500)
    ap.add_argument("--secret", default="", help="the peer's bench target --secret")
    ap.add_argument("--gid-index", type=int, default=None, help="perftest's -x")
    a = ap.parse_args(argv)
    nics = [n for n in a.nics.split(",") if n] or active_nics()
    report: dict[str, Any] = {"threshold": a.threshold, "peer": a.peer or None, "rows": []}
    missing = [t for t in TOOLS.values() if shutil.which(t) is None]
    if not nics:
        report["skipped"] = "no RDMA device with an ACTIVE port"
    elif missing:
        report["skipped"] = f"{', '.join(missing)} not found: apt install perftest"
    elif a.peer and len(a.secret) < 16:
        report["skipped"] = "--peer needs --secret (the peer's bench target's, >= 16 chars)"
    if "skipped" in report:
        print(json.dumps(report, indent=2))
        return 0
    rows = judge(
        nics,
        [o for o in a.ops.split(",") if o],
        perftest_measure(a.duration, a.peer, a.gid_index),
        mooncake_measure(a.duration, a.peer, a.peer_port, a.secret),
        a.threshold,
    )
    report["rows"] = [asdict(r) for r in rows]
    report["passed"] = all(r.passed for r in rows)
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
