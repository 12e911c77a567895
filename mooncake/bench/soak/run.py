"""`mooncake soak`'s run: a trace replayed for a set time against `up --local --masters N`
while faults strike, and what it shows.

    network   the nodes named in `netns_nodes` each behind a veth link (bench/soak/netns.py)
    start     the local cluster (etcd, masters, nodes), a supervisor restarting what dies
    replay    the trace's requests at their timestamps / speed, the trace looped to fill
              `duration_s`, each sent to the masters' APIs in turn; a request unanswered
              past its deadline (the cluster's `request_deadline_s` for its max_tokens,
              plus `hang_grace_s`) is hung
    faults    one every `fault_interval_s` (bench/soak/faults.py), none in the last stretch
    memory    every process's RSS every `rss_every_s` (bench/soak/rss.py)
    end       every master's API must answer a one-token request (within settle_s)

A failed request's kind comes from its shape (`RequestRecord.error_kind`); it is clear when
it tells the client what happened so it can retry: an HTTP error with an OpenAI error type
(not 500, an internal error), an error event in the stream, a refused or cut connection.
Hung requests, streams that end with neither a finish nor an error, and bad data are not.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import msgspec

from mooncake.bench.faults import send_by
from mooncake.bench.soak.faults import Deck, FaultPlan, FaultRecord, Striker
from mooncake.bench.soak.netns import Links
from mooncake.bench.soak.rss import ProcessRss, RssSampler
from mooncake.config.load import load_config
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.local.supervisor import NodeEvent, RestartPolicy
from mooncake.replay.client import probe_server
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import RequestRecord
from mooncake.replay.runner import ReplayConfig, request_body, resolve_vocab
from mooncake.roles.master.flight import request_deadline_s
from mooncake.sim.synth import LengthDist, SynthParams, synthesize
from mooncake.sim.trace import TraceRecord

UNCLEAR = ("hung", "ended early", "bad data", "timeout", "http 500")
# a soak kills nodes over and over: restart at once, never give up on one
SOAK_RESTARTS = RestartPolicy(backoff_s=0.5, max_backoff_s=2.0, limit=1_000_000)


@dataclass(frozen=True)
class SoakConfig:
    """How long, how hard, and what counts as passing."""

    duration_s: float = 600.0
    fault_interval_s: float = 30.0
    warmup_s: float = 60.0  # RSS samples this long after a process's start are cut
    speed: float = 1.0  # arrival speed-up of the trace
    seed: int = 0  # which faults and nodes, in which order
    netns_nodes: tuple[str, ...] = ("decode-0", "store-0")  # each behind a veth link
    faults: FaultPlan = field(default_factory=FaultPlan)
    hang_grace_s: float = 30.0  # past the cluster's deadline for a request: hung
    rss_every_s: float = 5.0
    rss_limit: float = 0.2  # growth after warm-up that fails the check
    failover_limit_s: float = 5.0  # a new leader and the nodes back within this


class SoakProgress(msgspec.Struct, kw_only=True):
    """A running soak, for a progress display."""

    elapsed_s: float
    duration_s: float
    sent: int
    completed: int
    failed: int  # answered with an error, rejections included
    hung: int
    num_faults: int
    last: str  # the last thing that happened


class SoakReport(msgspec.Struct, kw_only=True):
    """What `mooncake soak` reports (seconds unless named otherwise)."""

    duration_s: float
    fault_interval_s: float
    warmup_s: float
    netns_nodes: list[str]
    sent: int
    completed: int
    rejected: int  # HTTP 429
    failed: int  # answered with an error (hung ones not included)
    hung: int  # unanswered past their deadline + hang_grace_s
    errors: dict[str, int]  # error kind -> requests (rejections too)
    error_examples: dict[str, str]  # error kind -> the first message of that kind
    unclear_errors: int  # failed requests whose kind is not a clear error
    faults: list[FaultRecord]
    restarts: int  # node processes the supervisor started again
    rss: list[ProcessRss]
    serves_at_end: bool  # every master's API answered a one-token request at the end
    end_error: str = ""
    checks: dict[str, bool] = {}  # the figures the soak must reach, each passed or not


def default_trace(seed: int = 0) -> list[TraceRecord]:
    """A mixed workload (conversations, agents sharing prompts, document QA), about one
    request a second for a few minutes; a soak loops it."""
    p = SynthParams(
        mix={"conversation": 1.0, "agent": 1.0, "docqa": 1.0},
        sessions=60,
        rate=0.25,
        turns=3.0,
        think_s=10.0,
        system_len=LengthDist(1000),
        tools_len=LengthDist(2000),
        user_len=LengthDist(300),
        doc_len=LengthDist(3000),
        output_len=LengthDist(200),
        docs=20,
        max_input=12000,
        seed=seed,
    )
    return synthesize(p)[0]


def arrivals(records: list[TraceRecord], speed: float, duration_s: float) -> list[float]:
    """Send times (s) of requests 0, 1, ... (request i is record i % len): the trace
    looped, a mean gap between loops, cut at `duration_s`."""
    first, last = records[0].timestamp, records[-1].timestamp
    span = (last - first) / 1000.0 / speed
    period = span + max(span / len(records), 0.1)
    out: list[float] = []
    while True:
        loop = len(out) // len(records)
        t = loop * period + (records[len(out) % len(records)].timestamp - first) / 1000.0 / speed
        if t >= duration_s:
            return out
        out.append(t)


def is_clear(kind: str) -> bool:
    """Whether a failure of this kind tells the client what happened (module docstring)."""
    return bool(kind) and not kind.startswith(UNCLEAR) and kind not in ("stream", "http")


def run_soak(
    plan: LocalPlan,
    cost_model: Path,
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: SoakConfig,
    on_event: Callable[[str], None] = lambda _: None,
    on_tick: Callable[[SoakProgress], None] = lambda _: None,
) -> SoakReport:
    """Set up the network, start the cluster, soak it, stop everything (the network too,
    also on an error or Ctrl-C); the report."""
    links = Links(list(cfg.netns_nodes)) if cfg.netns_nodes else None
    if links is not None:
        links.create()
        plan = replace(plan, host=links.host)
        plan.placements = {n: links.placement(n) for n in cfg.netns_nodes}
        on_event(f"network: {', '.join(cfg.netns_nodes)} behind veth links on {links.bridge}")
    try:
        launcher = LocalLauncher(plan, on_event, SOAK_RESTARTS)
        launcher.runfile = plan.run_dir / "local.json"  # NOTE: never the user's own cluster's
        restarts: list[NodeEvent] = []
        stop = threading.Event()
        launcher.start(str(cost_model))

        def on_node(e: NodeEvent) -> None:
            on_event(e.message)
            if e.kind == "restarted":
                restarts.append(e)

        watcher = threading.Thread(target=launcher.supervise, args=(stop, on_node), daemon=True)
        watcher.start()
        try:
            soak = _Soak(launcher, links, records, prompts, cfg, on_event, on_tick)
            report = asyncio.run(soak.run())
        finally:
            stop.set()
            watcher.join()
            launcher.stop()
        report.restarts = len(restarts)
        return report
    finally:
        if links is not None:
            links.delete()


class _Soak:
    """One soak's loops on one event loop: requests, faults, memory."""

    def __init__(
        self,
        launcher: LocalLauncher,
        links: Links | None,
        records: list[TraceRecord],
        prompts: PromptConfig,
        cfg: SoakConfig,
        on_event: Callable[[str], None],
        on_tick: Callable[[SoakProgress], None],
    ):
        self.launcher, self.links, self.records = launcher, links, records
        self.prompts, self.cfg, self.on_event, self.on_tick = prompts, cfg, on_event, on_tick
        self.apis = [str(c.ready["url"]) for c in launcher.children if c.role == "master"]
        self.sched = load_config(launcher.config_path).config.scheduler
        self.done: list[RequestRecord] = []
        self.faults: list[FaultRecord] = []
        self.rss = RssSampler(cfg.warmup_s)
        self.t0 = time.perf_counter()
        self.last = "started"
        self.num_sent = 0

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> SoakReport:
        cfg = self.cfg
        striker = Striker(
            self.launcher, self.apis, self.links, cfg.faults, random.Random(cfg.seed), self.clock
        )
        headers = (
            {"Authorization": f"Bearer {self.launcher.api_key}"} if self.launcher.api_key else {}
        )
        clients = [
            # NOTE: no read timeout: a request's bound is its deadline (send_by's hang_s)
            httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(10.0, read=None))
            for url in self.apis
        ]
        try:
            info = await probe_server(clients[0], self.apis[0])
            rcfg = ReplayConfig(url=self.apis[0])
            self.prompts = replace(self.prompts, vocab_size=resolve_vocab(rcfg, info))
            self.t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample_memory())
            faulter = asyncio.create_task(self._strike_faults(striker))
            ticker = asyncio.create_task(self._tick())
            await self._send(clients, info.model, rcfg)
            await faulter
            serves, why = await self._end_check(striker)
            sampler.cancel()
            ticker.cancel()
        finally:
            await striker.aclose()
            for c in clients:
                await c.aclose()
        return self._report(serves, why)

    async def _send(self, clients: list[httpx.AsyncClient], model: str, rcfg: ReplayConfig) -> None:
        times = arrivals(self.records, self.cfg.speed, self.cfg.duration_s)
        tasks = []
        for i, at in enumerate(times):
            if (delay := at - self.clock()) > 0:
                await asyncio.sleep(delay)
            rec = self.records[i % len(self.records)]
            body = request_body(rec, self.prompts, rcfg, model)
            hang_s = request_deadline_s(self.sched, int(body["max_tokens"])) + self.cfg.hang_grace_s
            client = clients[i % len(clients)]
            tasks.append(asyncio.create_task(self._one(client, body, i, hang_s)))
            self.num_sent += 1
        await asyncio.gather(*tasks)

    async def _one(
        self, client: httpx.AsyncClient, body: dict[str, object], i: int, hang_s: float
    ) -> None:
        done = await send_by(client, body, i, self.t0, hang_s)
        self.done.append(done)

    async def _strike_faults(self, striker: Striker) -> None:
        cfg = self.cfg
        deck = Deck(cfg.faults.kinds, random.Random(cfg.seed))
        # NOTE: the last stretch is fault-free, so the end check sees a settled cluster
        last_at = cfg.duration_s - min(cfg.faults.settle_s, cfg.fault_interval_s)
        at = cfg.fault_interval_s
        while at <= last_at:
            await asyncio.sleep(max(0.0, at - self.clock()))
            kind = deck.deal()
            self.last = f"{kind} fault at {self.clock():.0f} s"
            self.on_event(self.last)
            rec = await striker.strike(kind)
            self.faults.append(rec)
            self.last = _describe(rec)
            self.on_event(self.last)
            at = max(at + cfg.fault_interval_s, self.clock())

    async def _sample_memory(self) -> None:
        while True:
            pids = {c.node_id: c.proc.pid for c in self.launcher.children}
            if self.launcher.etcd is not None and self.launcher.etcd.proc is not None:
                pids["etcd"] = self.launcher.etcd.proc.pid
            await asyncio.to_thread(self.rss.sample, self.clock(), pids)
            await asyncio.sleep(self.cfg.rss_every_s)

    async def _tick(self) -> None:
        while True:
            failed = sum(r.status != "ok" and r.error_kind != "hung" for r in self.done)
            self.on_tick(
                SoakProgress(
                    elapsed_s=min(self.clock(), self.cfg.duration_s),
                    duration_s=self.cfg.duration_s,
                    sent=self.num_sent,
                    completed=sum(r.status == "ok" for r in self.done),
                    failed=failed,
                    hung=sum(r.error_kind == "hung" for r in self.done),
                    num_faults=len(self.faults),
                    last=self.last,
                )
            )
            await asyncio.sleep(0.5)

    async def _end_check(self, striker: Striker) -> tuple[bool, str]:
        """Every master's API answers a one-token request (each given settle_s)."""
        for url in self.apis:
            deadline = time.perf_counter() + self.cfg.faults.settle_s
            while not await striker.serves(url):
                if time.perf_counter() > deadline:
                    return False, f"{url} did not answer a one-token request at the end"
                await asyncio.sleep(0.5)
        return True, ""

    def _report(self, serves: bool, end_error: str) -> SoakReport:
        cfg, done = self.cfg, self.done
        kinds = Counter(r.error_kind or "unknown" for r in done if r.status != "ok")
        examples: dict[str, str] = {}
        for r in sorted(done, key=lambda r: r.index):
            if r.status != "ok":
                examples.setdefault(r.error_kind or "unknown", r.error[:200])
        hung = kinds.get("hung", 0)
        failed = [r for r in done if r.status == "error" and r.error_kind != "hung"]
        rss = self.rss.report()
        masters = [f for f in self.faults if f.kind == "master"]
        lost = [f for f in masters if (f.objects_after or 0) < (f.objects_before or 0)]
        checks = {
            "no_hung": hung == 0,
            "errors_clear": all(is_clear(r.error_kind) for r in failed),
            "rss_within": all((p.rss_growth or 0) <= cfg.rss_limit for p in rss),
            "serves_at_end": serves,
            "leader_within": all(_within(f.leader_s, cfg.failover_limit_s) for f in masters),
            "nodes_within": all(_within(f.nodes_s, cfg.failover_limit_s) for f in masters),
            "no_objects_lost": not lost and all(f.objects_after is not None for f in masters),
        }
        return SoakReport(
            duration_s=cfg.duration_s,
            fault_interval_s=cfg.fault_interval_s,
            warmup_s=cfg.warmup_s,
            netns_nodes=list(cfg.netns_nodes),
            sent=len(done),
            completed=sum(r.status == "ok" for r in done),
            rejected=sum(r.status == "rejected" for r in done),
            failed=len(failed),
            hung=hung,
            errors=dict(kinds),
            error_examples=examples,
            unclear_errors=sum(not is_clear(r.error_kind) for r in failed),
            faults=self.faults,
            restarts=0,
            rss=rss,
            serves_at_end=serves,
            end_error=end_error,
            checks=checks,
        )


def _within(value: float | None, limit: float) -> bool:
    return value is not None and value <= limit


def _describe(f: FaultRecord) -> str:
    """One line for a fault and the cluster's return."""
    if f.error:
        return f"{f.kind} {f.target}: {f.error}"
    parts = [f"{f.kind} {f.target} ({f.how})"]
    for name, value in (("leader", f.leader_s), ("nodes", f.nodes_s), ("serves", f.serve_s)):
        if f.kind == "master" or name == "nodes" and f.kind != "link":
            parts.append(f"{name} {'never' if value is None else f'{value:.1f} s'}")
    if f.kind == "master":
        parts.append(f"objects {f.objects_before} -> {f.objects_after}")
    return ", ".join(parts)
