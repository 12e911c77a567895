"""One run of `mooncake bench store --clients N`: our master per journal, then upstream's.

    rows = run_load(LoadPlan(clients=(8, 32), journals=("file", "etcd")), secret)

For each client count, N client processes of ours (bench/storeload.py) load a fresh local
master per journal ("none", "file": a file in a temporary folder, "etcd": a one-member
etcd on loopback whose data lives in tmpfs, as `up --local` runs it), each with one store
node; then, with `upstream`, N drivers of upstream's Python API load upstream's
mooncake_master the same way. With `profile_dir`, py-spy samples each master of ours
while its clients run (`--gil`: the thread holding the GIL, which is what a saturated
Python master is short of) and writes its collapsed stacks there; `top_entries` reads them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from mooncake.bench.storeload import LoadClients, LoadRow, merge
from mooncake.bench.storeprocs import JournalSpec, LocalCluster
from mooncake.errors import ConfigError

JOURNALS = ("none", "file", "etcd")
# etcd with its group commit set: "etcd4" (4 groups in flight), "etcd1w0.5" (one, with a
# 0.5 ms window); plain "etcd" takes [cluster]'s defaults
_ETCD_SPEC = re.compile(r"etcd(?P<in_flight>[1-9][0-9]?)?(?:w(?P<window_ms>[0-9]+(?:\.[0-9]+)?))?")
PROFILE_RATE_HZ = 250  # py-spy samples per second


class LoadPlan(msgspec.Struct, frozen=True):
    clients: tuple[int, ...]  # client processes, one run per count
    journals: tuple[str, ...] = ("file", "etcd")  # our masters: JOURNALS
    value_bytes: int = 512  # bytes per value
    duration_s: float = 5.0  # seconds every client runs
    pool_bytes: int = 256 << 20  # the store node's DRAM tier
    upstream: str = ""  # Python of upstream's venv ("" = ours only)
    profile_dir: str = ""  # where py-spy's collapsed stacks go ("" = no profile)


def py_spy() -> str:
    """py-spy's path (beside this Python, or on PATH); ConfigError when there is none."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise ConfigError("--profile needs py-spy (pip install py-spy) beside Python or on PATH")
    return found


@contextlib.contextmanager
def _etcd(needed: bool, folder: Path) -> Iterator[JournalSpec]:
    if not needed:
        yield JournalSpec()
        return
    from mooncake.ha.localetcd import LocalEtcd, tmpfs_data_dir

    etcd = LocalEtcd(tmpfs_data_dir(folder / "etcd"))
    try:
        etcd.start()
        yield JournalSpec("etcd", etcd.url, etcd.access.password)
    finally:
        etcd.stop()


def _etcd_variant(base: JournalSpec, name: str) -> tuple[JournalSpec, str]:
    """The etcd journal `name` (`_ETCD_SPEC`) on `base`'s etcd, and its row label."""
    m = _ETCD_SPEC.fullmatch(name)
    assert m is not None, name
    spec, label = base, "etcd journal"
    if m["in_flight"]:
        spec = spec._replace(in_flight=int(m["in_flight"]))
        label += f", {spec.in_flight} in flight"
    if m["window_ms"]:
        spec = spec._replace(window_s=float(m["window_ms"]) / 1e3)
        label += f", {m['window_ms']} ms window"
    return spec, label


def run_load(plan: LoadPlan, secret: bytes) -> list[LoadRow]:
    """Every (client count, master) of `plan`, ours first; one row each."""
    bad = [j for j in plan.journals if j not in JOURNALS and not _ETCD_SPEC.fullmatch(j)]
    if bad:
        raise ConfigError(
            f"--journals: unknown {', '.join(bad)}; choose from {', '.join(JOURNALS)}, or "
            "etcdN / etcdNwM for etcd with N (1-99) groups in flight and an M ms window"
        )
    needs_etcd = any(j.startswith("etcd") for j in plan.journals)
    spy = py_spy() if plan.profile_dir else ""
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mooncake-load-") as tmp,
        _etcd(needs_etcd, Path(tmp)) as etcd,
    ):
        for num in plan.clients:
            with LoadClients(num, secret) as clients:
                for i, kind in enumerate(plan.journals):
                    label = f"{kind} journal"
                    if kind == "none":
                        journal = JournalSpec()
                    elif kind == "file":
                        journal = JournalSpec("file", f"{tmp}/{num}-{i}.j")
                    else:
                        base = etcd._replace(prefix=f"/bench-{num}-{i}")
                        journal, label = _etcd_variant(base, kind)
                    with LocalCluster(secret, plan.pool_bytes, journal=journal) as cluster:
                        out = Path(plan.profile_dir) / f"ours-{kind}-{num}.txt"
                        pid = cluster.master.proc.pid
                        cpu0 = cpu_seconds(pid)
                        with _profiler(spy, pid, out, plan.duration_s) as on_go:
                            figures = clients.run(
                                cluster.master_address, plan.value_bytes, plan.duration_s, on_go
                            )
                        row = merge(f"ours ({label})", plan.value_bytes, figures)
                        rows.append(_with_cpu(row, cpu_seconds(pid) - cpu0))
            if plan.upstream:
                from mooncake.bench.upstream import UpstreamLoad

                with UpstreamLoad(plan.upstream, plan.pool_bytes, num) as up:
                    master_pid = up.children[0].proc.pid
                    cpu0 = cpu_seconds(master_pid)
                    figures = up.run(plan.value_bytes, plan.duration_s)
                    row = merge("upstream", plan.value_bytes, figures)
                    rows.append(_with_cpu(row, cpu_seconds(master_pid) - cpu0))
    return rows


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) process `pid` has used so far; 0 when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _with_cpu(row: LoadRow, cpu_s: float) -> LoadRow:
    """`row` with its master's CPU: cores it kept busy over the run (1.0: one core)."""
    return msgspec.structs.replace(row, master_cores=round(cpu_s / row.seconds, 2))


@contextlib.contextmanager
def _profiler(
    spy: str, pid: int | None, out: Path, duration_s: float
) -> Iterator[Callable[[], None]]:
    """Yields the callback that starts py-spy on `pid` (when `spy`); waits for its file."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        if spy and pid is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            argv = [spy, "record", "--pid", str(pid), "--gil", "--nonblocking", "--function"]
            argv += ["--format"]
            argv += ["raw", "--rate", str(PROFILE_RATE_HZ), "--duration", str(int(duration_s))]
            procs.append(subprocess.Popen([*argv, "--output", str(out)], stdout=subprocess.DEVNULL))

    try:
        yield start
    finally:
        for proc in procs:
            proc.wait(duration_s + 30)


def busy_share(path: Path, duration_s: float) -> float:
    """The share of the run in which a thread of the master held the GIL: py-spy `--gil`
    samples only then, PROFILE_RATE_HZ a second. Near 1: the master is the limit."""
    num = sum(int(c) for c in _counts(path))
    return num / (PROFILE_RATE_HZ * int(duration_s)) if duration_s >= 1 else 0.0


def _counts(path: Path) -> list[str]:
    return [line.rpartition(" ")[2] for line in path.read_text().splitlines() if " " in line]


def top_entries(path: Path, n: int = 15) -> list[tuple[str, float, float]]:
    """(function, share of samples in it, share with it on the stack) of py-spy's collapsed
    stacks at `path`, the `n` largest own shares first."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    num = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        num += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            total[frame] += int(count)
    return [(f, c / num, total[f] / num) for f, c in own.most_common(n)] if num else []
