"""A trace replayed against a local cluster while one of its nodes fails: what completes,
what fails, what hangs, and how long until the cluster serves again.

    start     a fresh `up --local` cluster, its supervisor restarting nodes that exit
    replay    the trace's requests at their timestamps / speed, each with a deadline
    fault     at `at_s`: SIGKILL a node (the supervisor starts it again), or SIGSTOP it
              for `stop_s` seconds and SIGCONT it (alive all along: not restarted)
    probe     from the fault on, a one-token request every `probe_s` seconds; the first
              one answered is the time to serve again
    report    completed / rejected / failed / hung per fault, beside the same replay with no
              fault (the baseline, in the same run)

A request still unanswered `hang_s` after it was sent is hung: it is cancelled and counted
apart from failures, which are answers (an error the client can act on).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec

from mooncake.errors import ConfigError
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.local.supervisor import NodeEvent
from mooncake.replay.client import probe_server, send_completion
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import RequestRecord
from mooncake.replay.runner import ReplayConfig, request_body, resolve_vocab, send_at_arrivals
from mooncake.sim.trace import TraceRecord

log = logging.getLogger(__name__)


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One failure to inject."""

    name: str
    node_id: str = ""  # the node it hits ("" = none: the baseline)
    action: Literal["none", "kill", "stop"] = "none"
    stop_s: float = 0.0  # stop: seconds between SIGSTOP and SIGCONT


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(name="none"),
        Fault(name="decode-kill", node_id="decode-0", action="kill"),
        Fault(name="store-kill", node_id="store-0", action="kill"),
        Fault(name="prefill-stage1-kill", node_id="prefill-1", action="kill"),
        Fault(name="master-kill", node_id="master", action="kill"),
        Fault(name="decode-stop", node_id="decode-0", action="stop", stop_s=30.0),
    )
}


def parse_faults(names: str) -> list[Fault]:
    """Faults named in a comma-separated list; raises ConfigError naming an unknown one."""
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in FAULTS:
            raise ConfigError(f"--faults: unknown fault {name!r}; known: {', '.join(FAULTS)}")
        out.append(FAULTS[name])
    if not out:
        raise ConfigError(f"--faults: name at least one of {', '.join(FAULTS)}")
    return out


class FaultResult(msgspec.Struct, kw_only=True):
    """What one replay under one fault did."""

    fault: str
    sent: int
    completed: int
    rejected: int  # HTTP 429
    failed: int  # answered with an error
    hung: int  # no answer within hang_s
    serve_again_s: float | None  # fault -> first probe answered; None: never in the run
    restarts: int  # node processes the supervisor started again
    ttft_p50_s: float | None  # over completed requests
    errors: dict[str, int] = {}  # error message -> count


@dataclass(frozen=True)
class FaultRun:
    """How every fault is replayed."""

    at_s: float = 8.0  # seconds into the replay the fault strikes
    hang_s: float = 120.0  # seconds without an answer that make a request hung
    probe_s: float = 0.25  # seconds between probes after the fault
    settle_s: float = 60.0  # seconds the probe may wait for the cluster to serve again


def run_fault(
    fault: Fault,
    plan: LocalPlan,
    cost_model: Path,
    records: list[TraceRecord],
    prompts: PromptConfig,
    run: FaultRun,
    on_progress: Callable[[str], None] = lambda _: None,
) -> FaultResult:
    """Start a cluster, replay `records` with `fault` injected, stop the cluster."""
    launcher = LocalLauncher(plan, on_progress)
    launcher.runfile = plan.run_dir / "local.json"  # NOTE: never the user's own cluster's
    restarts: list[NodeEvent] = []
    stop = threading.Event()
    launcher.start(str(cost_model))

    def on_event(e: NodeEvent) -> None:
        on_progress(e.message)
        if e.kind == "restarted":
            restarts.append(e)

    watcher = threading.Thread(target=launcher.supervise, args=(stop, on_event), daemon=True)
    watcher.start()
    try:
        cfg = ReplayConfig(url=launcher.url, api_key=launcher.api_key, timeout_s=run.hang_s + 10)
        result = asyncio.run(_replay(fault, launcher, records, prompts, cfg, run))
    finally:
        stop.set()
        watcher.join()
        launcher.stop()
    result.restarts = len(restarts)
    return result


async def _replay(
    fault: Fault,
    launcher: LocalLauncher,
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: ReplayConfig,
    run: FaultRun,
) -> FaultResult:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=httpx.Timeout(cfg.timeout_s)
    ) as client:
        info = await probe_server(client, cfg.url)
        prompts = replace(prompts, vocab_size=resolve_vocab(cfg, info))
        t0 = time.perf_counter()
        hung: list[int] = []

        async def one(i: int, rec: TraceRecord) -> RequestRecord:
            body = request_body(rec, prompts, cfg, info.model)
            done = await send_by(client, body, i, t0, run.hang_s)
            if done.error_kind == "hung":
                hung.append(i)
            return done

        fault_task = asyncio.create_task(_strike(fault, launcher, run.at_s))
        probe_task = asyncio.create_task(_probe(client, info.model, run, t0))
        done = await send_at_arrivals(records, cfg.speed, t0, one)
        await fault_task
        serve_again = await probe_task if fault.action != "none" else None
    ok = [r for r in done if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in done:
        if r.status != "ok":
            key = r.error[:120]
            errors[key] = errors.get(key, 0) + 1
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return FaultResult(
        fault=fault.name,
        sent=len(done),
        completed=len(ok),
        rejected=sum(r.status == "rejected" for r in done),
        failed=sum(r.status == "error" for r in done) - len(hung),
        hung=len(hung),
        serve_again_s=serve_again,
        restarts=0,
        ttft_p50_s=ttfts[len(ttfts) // 2] if ttfts else None,
        errors=errors,
    )


async def send_by(
    client: httpx.AsyncClient, body: dict[str, Any], index: int, t0: float, hang_s: float
) -> RequestRecord:
    """`send_completion`, given up after `hang_s` seconds: then a record of kind "hung"."""
    try:
        return await asyncio.wait_for(send_completion(client, body, index, t0), hang_s)
    except TimeoutError:
        now = time.perf_counter() - t0
        return RequestRecord(
            index=index,
            status="error",
            send_s=now - hang_s,
            end_s=now,
            error=f"hung: no answer within {hang_s:g} s",
            error_kind="hung",
        )


async def _strike(fault: Fault, launcher: LocalLauncher, at_s: float) -> None:
    """Inject the fault at `at_s` seconds (a stop lasts `stop_s`, then SIGCONT)."""
    if fault.action == "none":
        return
    await asyncio.sleep(at_s)
    pid = launcher.processes()[fault.node_id].pid
    if fault.action == "kill":
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(fault.stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)


async def _probe(client: httpx.AsyncClient, model: str, run: FaultRun, t0: float) -> float | None:
    """Seconds from the fault to the first one-token request answered after it."""
    await asyncio.sleep(max(0.0, run.at_s - (time.perf_counter() - t0)))
    struck = time.perf_counter()
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    while time.perf_counter() - struck < run.settle_s:
        try:
            r = await client.post("/v1/completions", json=body, timeout=5.0)
            if r.status_code == 200:
                return time.perf_counter() - struck
        except httpx.HTTPError:
            pass
        await asyncio.sleep(run.probe_s)
    return None
