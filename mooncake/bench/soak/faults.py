"""The soak's faults: which one strikes next, striking it, and timing the cluster's return.

    master   SIGKILL the leading master; time until another master leads and answers
             /v1/status (`leader_s`), until every node is registered and ready with it
             (`nodes_s`), until a one-token request is answered (`serve_s`); the pool's
             committed objects counted just before the kill and once the nodes are back
    prefill, decode, store
             SIGKILL one such node (chosen at random); the launcher's supervisor starts it
             again; `nodes_s` is the time until the new process reported ready and the
             leader lists the node ready
    link     degrade one namespaced node's veth link (netns.Links.degrade) for
             `degrade_s`, then restore it

Kinds are dealt from a shuffled deck (all of them before any repeats), so a short soak
still strikes each; the node of a kind is drawn at random. Times are seconds from the
strike; None means "not within settle_s".
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import msgspec

from mooncake.bench.soak.netns import Degrade, Links, NetnsError
from mooncake.local.launcher import LocalLauncher

FaultKind = Literal["master", "prefill", "decode", "store", "link"]
KINDS: tuple[FaultKind, ...] = ("master", "prefill", "decode", "store", "link")
ONE_TOKEN = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}


class FaultRecord(msgspec.Struct, kw_only=True):
    """One fault and how the cluster came back from it."""

    kind: str  # a FaultKind
    target: str  # node id (the master's id for a master fault)
    at_s: float  # seconds into the soak
    how: str  # "SIGKILL pid N", or how the link was degraded
    leader_s: float | None = None  # master: another master leads and answers
    nodes_s: float | None = None  # every node (or the killed one) ready again
    serve_s: float | None = None  # master: a one-token request answered
    objects_before: int | None = None  # master: committed pool objects before the kill
    objects_after: int | None = None  # master: ... once the nodes were back
    error: str = ""  # why the strike or a measurement could not be made


@dataclass(frozen=True)
class FaultPlan:
    """What strikes and how long the cluster is given to come back."""

    kinds: tuple[FaultKind, ...] = KINDS
    settle_s: float = 25.0  # seconds each recovery is waited for at most
    poll_s: float = 0.1  # seconds between looks at the cluster while it recovers
    degrade: Degrade = Degrade()
    degrade_s: float = 15.0  # seconds a link stays degraded


class Deck:
    """Fault kinds dealt in shuffled rounds (`random.Random(seed)`)."""

    def __init__(self, kinds: Sequence[FaultKind], rng: random.Random):
        self.kinds, self.rng = list(kinds), rng
        self._left: list[FaultKind] = []

    def deal(self) -> FaultKind:
        if not self._left:
            self._left = self.rng.sample(self.kinds, len(self.kinds))
        return self._left.pop()


class Striker:
    """Strikes faults on one local cluster and measures its return."""

    def __init__(
        self,
        launcher: LocalLauncher,
        apis: list[str],  # every master's API base URL
        links: Links | None,
        plan: FaultPlan,
        rng: random.Random,
        clock: Callable[[], float],  # seconds into the soak
    ):
        self.launcher, self.apis, self.links = launcher, apis, links
        self.plan, self.rng, self.clock = plan, rng, clock
        headers = {"Authorization": f"Bearer {launcher.api_key}"} if launcher.api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(5.0))
        self.num_nodes = sum(c.role != "master" for c in launcher.children)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def strike(self, kind: FaultKind) -> FaultRecord:
        """Inject one fault of `kind` and wait for the cluster to come back (at most
        settle_s per measurement, or degrade_s for a link)."""
        if kind == "master":
            return await self._kill_leader()
        if kind == "link":
            return await self._degrade()
        return await self._kill_node(kind)

    async def status(self, url: str) -> dict[str, Any] | None:
        """The master's /v1/status at `url`, None when it does not answer 200."""
        try:
            r = await self._client.get(url + "/v1/status")
        except httpx.HTTPError:
            return None
        return dict(r.json()) if r.status_code == 200 else None

    async def leader(self) -> tuple[str, dict[str, Any]] | None:
        """(API URL, status) of a master whose status names a leader answering it."""
        for url in self.apis:
            st = await self.status(url)
            if st is not None and any(m["is_leader"] for m in st.get("masters", [])):
                return url, st
        return None

    async def serves(self, url: str) -> bool:
        """Whether a one-token completion through `url` is answered 200."""
        try:
            r = await self._client.post(url + "/v1/completions", json=ONE_TOKEN)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _nodes_ready(self, st: dict[str, Any], node_id: str = "") -> bool:
        nodes = [n for n in st["nodes"] if n["role"] != "master"]
        if node_id:
            return any(n["node_id"] == node_id and n["state"] == "ready" for n in nodes)
        return len(nodes) >= self.num_nodes and all(n["state"] == "ready" for n in nodes)

    async def _until(self, check: Callable[[], Any], t0: float) -> float | None:
        """Seconds from `t0` (perf_counter) until `await check()` is truthy; None past settle."""
        while time.perf_counter() - t0 < self.plan.settle_s:
            if await check():
                return time.perf_counter() - t0
            await asyncio.sleep(self.plan.poll_s)
        return None

    async def _kill_leader(self) -> FaultRecord:
        found = await self.leader()
        if found is None:
            return FaultRecord(
                kind="master",
                target="",
                at_s=self.clock(),
                how="",
                error="no master leads: nothing to kill",
            )
        _, st = found
        old = next(m for m in st["masters"] if m["is_leader"])
        rec = FaultRecord(
            kind="master",
            target=old["id"],
            at_s=self.clock(),
            how=f"SIGKILL pid {old['pid']}",
            objects_before=st.get("num_pool_objects"),
        )
        t0 = time.perf_counter()
        os.kill(old["pid"], signal.SIGKILL)
        latest: dict[str, Any] = {}

        async def new_leader() -> bool:
            found = await self.leader()
            if found is None:
                return False
            lead = next(m for m in found[1]["masters"] if m["is_leader"])
            latest.update(found[1])
            return lead["id"] != old["id"] or lead["pid"] != old["pid"]

        async def nodes_back() -> bool:
            found = await self.leader()
            if found is None or not self._nodes_ready(found[1]):
                return False
            latest.update(found[1])
            return True

        async def serves() -> bool:
            return any([await self.serves(url) for url in self.apis])

        rec.leader_s = await self._until(new_leader, t0)
        rec.nodes_s = await self._until(nodes_back, t0)
        rec.objects_after = latest.get("num_pool_objects") if rec.nodes_s is not None else None
        rec.serve_s = await self._until(serves, t0)
        return rec

    async def _kill_node(self, role: str) -> FaultRecord:
        ids = sorted(c.node_id for c in self.launcher.children if c.role == role)
        # NOTE: a node still starting again after an earlier fault is spared
        ready = [n for n in ids if self.launcher.is_ready(n)]
        if not ready:
            why = f"no {role} node is ready to kill" if ids else f"the cluster has no {role} node"
            return FaultRecord(kind=role, target="", at_s=self.clock(), how="", error=why)
        node_id = self.rng.choice(ready)
        proc = self.launcher.processes().get(node_id)
        if proc is None or proc.poll() is not None:
            return FaultRecord(
                kind=role, target=node_id, at_s=self.clock(), how="", error="not running"
            )
        rec = FaultRecord(
            kind=role, target=node_id, at_s=self.clock(), how=f"SIGKILL pid {proc.pid}"
        )
        t0 = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)

        async def back() -> bool:
            now = self.launcher.processes().get(node_id)
            if now is None or now.pid == proc.pid or not self.launcher.is_ready(node_id):
                return False
            found = await self.leader()
            return found is not None and self._nodes_ready(found[1], node_id)

        rec.nodes_s = await self._until(back, t0)
        return rec

    async def _degrade(self) -> FaultRecord:
        if self.links is None or not self.links.node_ids:
            return FaultRecord(
                kind="link",
                target="",
                at_s=self.clock(),
                how="",
                error="no node runs in a network namespace",
            )
        node_id = self.rng.choice(self.links.node_ids)
        rec = FaultRecord(kind="link", target=node_id, at_s=self.clock(), how="")
        try:
            rec.how = await asyncio.to_thread(self.links.degrade, node_id, self.plan.degrade)
            await asyncio.sleep(self.plan.degrade_s)
        except NetnsError as e:  # a failed tc command is reported; the soak goes on
            rec.error = str(e)
        finally:
            await asyncio.to_thread(self.links.restore, node_id)
        return rec
