"""`StoreListeners`: where the master's Store events go: the Conductor's prefix index
(under the master's lock), then the miss attribution's ledger (`roles/master/attribution.py`),
and, when `[kv_events]` is on, the pool's vLLM-format feed."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Literal

from mooncake.conductor.index import IndexUpdate, PrefixIndex
from mooncake.kv.keys import parse_kv_key
from mooncake.kvevents.feed import PoolFeed
from mooncake.store.metadata.objects import StoreEvent

if TYPE_CHECKING:
    from mooncake.roles.master.attribution import Attribution

log = logging.getLogger(__name__)
IndexKind = Literal["added", "evicted", "demoted", "node_gone"]
_KINDS: dict[str, IndexKind] = {
    "added": "added",
    "evicted": "evicted",
    "removed": "evicted",
    "demoted": "demoted",
    "promoted": "demoted",
    "node_gone": "node_gone",
}


class StoreListeners:
    def __init__(
        self,
        index: PrefixIndex,
        lock: threading.Lock,
        feed: PoolFeed | None,
        misses: Attribution | None = None,
    ):
        self.index = index
        self.lock = lock  # the master's: guards the Conductor
        self.feed = feed
        self.misses = misses

    def on_events(self, events: list[StoreEvent]) -> None:
        """The Store's events (runs under the Store's lock, on its thread)."""
        log.debug("%d store events, first %s", len(events), events[0])
        now = time.monotonic()
        with self.lock:
            for e in events:
                kind = _KINDS.get(e.kind)
                if kind is None:
                    continue
                h = None
                if kind == "node_gone":
                    self.index.apply(IndexUpdate(kind="node_gone", node=e.node_id))
                else:
                    h = parse_kv_key(e.key)
                    if h is None:
                        continue
                    tier = e.tier or "dram"
                    self.index.apply(
                        IndexUpdate(kind=kind, node=e.node_id, block_hashes=(h,), tier=tier)
                    )
                if self.misses is not None:
                    self.misses.event(kind, h, now)  # NOTE: after the index
        if self.feed is not None:
            self.feed.on_events(events)
