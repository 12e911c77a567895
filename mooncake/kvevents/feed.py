"""`PoolFeed`: the master's KV event feed, from the Store's events to the PUB socket.

feed = create_pool_feed(config)      # None when [kv_events] enabled = false
StoreService(..., on_events=feed.on_events)
feed.status()                        # what `mooncake status --json` shows as kv_events
feed.close()
"""

from __future__ import annotations

import threading

from mooncake.api.status import KvEventsStatus
from mooncake.config.portrange import node_ports
from mooncake.config.settings import Config
from mooncake.kvevents.pool import PoolEvents
from mooncake.kvevents.publisher import Publisher
from mooncake.store.metadata.objects import StoreEvent


class PoolFeed:
    """Translates the Store's events (on the Store's thread) and hands them to the
    publisher's thread."""

    def __init__(self, events: PoolEvents, publisher: Publisher, topic: str):
        self.events = events
        self.publisher = publisher
        self.topic = topic
        self._lock = threading.Lock()  # NOTE: guards `events` (status reads its ranks)

    def on_events(self, events: list[StoreEvent]) -> None:
        """Publish these pool changes (called under the Store's lock: returns at once)."""
        with self._lock:
            batches = self.events.translate(events)
        self.publisher.publish(batches)

    def status(self) -> KvEventsStatus:
        with self._lock:
            ranks = dict(self.events.ranks)
        p = self.publisher
        return KvEventsStatus(
            endpoint=p.endpoint, replay_endpoint=p.replay_endpoint, topic=self.topic, ranks=ranks
        )

    def close(self) -> None:
        self.publisher.close()


def create_pool_feed(config: Config) -> PoolFeed | None:
    """The feed `[kv_events]` asks for (sockets bound), or None when it is off."""
    kv = config.kv_events
    if not kv.enabled:
        return None
    pub = Publisher(
        kv.endpoint,
        kv.replay_endpoint,
        topic=kv.topic,
        buffer_steps=kv.buffer_steps,
        ports=node_ports(config),
    )
    return PoolFeed(PoolEvents(config.model.block_tokens), pub, kv.topic)
