"""The master's metrics port: `/metrics` and upstream Mooncake's read-only admin queries.

Upstream's `mooncake_master` serves these on its metrics port (`--metrics_port`, 9003), and
SGLang's HiCache backend polls `GET /get_all_segments` there. Paths, content types and bodies
follow kvcache-ai/Mooncake `mooncake-store/src/master_admin_service.cpp` and
`docs/source/api-reference/http/http-service.md`:

| path | answer |
|---|---|
| `/metrics` | Prometheus text (the master's registry) |
| `/metrics/summary` | a few lines: segments, keys, bytes used of capacity |
| `/health` | JSON: status, role (leader/standby), ha_state, service_ready |
| `/get_all_segments` | one mounted segment name per line |
| `/query_segment?segment=S` | `S`, `Used(bytes): N`, `Capacity(bytes) : N` (upstream's) |
| `/get_segments_detail` | JSON: total_segments, segments (name, endpoint, sizes, status) |
| `/get_all_keys` | one committed key per line |
| `/query_key?key=K` | JSON: success, data (replicas); 404 with -704 when missing |
| `/batch_query_keys?keys=a,b` | JSON: success, data: key -> {ok, values or error} |

All are GET. Upstream's mutating admin routes (drain jobs, tenant quotas,
`POST /api/v1/remove_all`) are left out: this port has no authentication. NOTE: key and
segment names are visible to anyone who reaches this port, as upstream's are; bind
`metrics.host` to a private address.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mooncake.store.metadata.objects import COMPLETE, ObjectRecord, Segment
from mooncake.store.metadata.service import MetadataService

log = logging.getLogger(__name__)

TEXT = "text/plain; version=0.0.4"  # upstream's content type for its plain-text answers
JSON = "application/json; charset=utf-8"
OBJECT_NOT_FOUND = -704  # upstream's ErrorCode::OBJECT_NOT_FOUND (error-code.md)
SEGMENT_NOT_FOUND = -101  # upstream's ErrorCode::SEGMENT_NOT_FOUND


class PoolView:
    """Read-only answers about the pool, each taken under the Store service's lock."""

    def __init__(self, metadata: MetadataService, lock: threading.Lock):
        self.metadata, self.lock = metadata, lock

    def segment_names(self) -> list[str]:
        with self.lock:
            return sorted(self.metadata.space.segments)

    def segment(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            seg = self.metadata.space.segments.get(name)
            return None if seg is None else _segment_detail(seg)

    def segments(self) -> list[dict[str, Any]]:
        with self.lock:
            segs = sorted(self.metadata.space.segments.values(), key=lambda s: s.name)
            return [_segment_detail(s) for s in segs]

    def keys(self) -> list[str]:
        with self.lock:
            return sorted(k for k, o in self.metadata.pool.objects.items() if o.is_committed)

    def replicas(self, key: str) -> list[dict[str, Any]] | None:
        """The complete replicas of a committed `key`, or None when there is none."""
        with self.lock:
            obj = self.metadata.pool.objects.get(key)
            return None if obj is None or not obj.is_committed else _replicas(obj)


def _segment_detail(seg: Segment) -> dict[str, Any]:
    alloc = seg.allocator
    return {
        "segment_name": seg.name,
        "node_id": seg.node_id,
        "tier": seg.tier,
        "te_endpoint": seg.endpoint,
        "size_bytes": seg.capacity,
        "size_human": f"{seg.capacity / (1 << 30):g} GiB",
        "status": "MOUNTED",
        "allocator_used_bytes": alloc.used_bytes,
        "allocator_capacity_bytes": alloc.usable_bytes,
        "allocator_usage_percent": (
            100.0 * alloc.used_bytes / alloc.usable_bytes if alloc.usable_bytes else 0.0
        ),
    }


def _replicas(obj: ObjectRecord) -> list[dict[str, Any]]:
    # NOTE: upstream names a replica by its buffer's address on its owner; ours by segment
    # and offset, which is what a reader needs here
    return [
        {
            "size_": r.size,
            "segment_name": r.segment.name,
            "offset": r.offset,
            "tier": r.tier,
            "transport_endpoint_": r.segment.endpoint,
        }
        for r in obj.replicas
        if r.state == COMPLETE
    ]


Answer = tuple[int, str, bytes]  # (HTTP status, content type, body)


def _text(lines: list[str]) -> Answer:
    return 200, TEXT, "".join(f"{line}\n" for line in lines).encode()


def _json(status: int, body: object) -> Answer:
    return status, JSON, json.dumps(body).encode()


class AdminRoutes:
    """What each path answers; `answer(path_and_query)` never raises on bad input."""

    def __init__(self, view: PoolView, registry: CollectorRegistry, role: Callable[[], str]):
        self.view, self.registry, self.role = view, registry, role

    def answer(self, target: str) -> Answer:
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        route = {
            "/metrics": self._metrics,
            "/metrics/summary": self._summary,
            "/health": self._health,
            "/get_all_segments": lambda _q: _text(self.view.segment_names()),
            "/query_segment": self._query_segment,
            "/get_segments_detail": self._segments_detail,
            "/get_all_keys": lambda _q: _text(self.view.keys()),
            "/query_key": self._query_key,
            "/batch_query_keys": self._batch_query_keys,
        }.get(url.path.rstrip("/") or "/")
        if route is None:
            return _json(404, {"success": False, "error": f"no route {url.path}"})
        return route(query)

    def _metrics(self, _q: dict[str, str]) -> Answer:
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def _summary(self, _q: dict[str, str]) -> Answer:
        segs = self.view.segments()
        used = sum(s["allocator_used_bytes"] for s in segs)
        cap = sum(s["allocator_capacity_bytes"] for s in segs)
        return _text(
            [
                f"Segments: {len(segs)}",
                f"Keys: {len(self.view.keys())}",
                f"Used(bytes): {used}",
                f"Capacity(bytes): {cap}",
            ]
        )

    def _health(self, _q: dict[str, str]) -> Answer:
        role = self.role()
        body = {"status": "ok", "role": role, "ha_state": role, "service_ready": role == "leader"}
        return _json(200, body)

    def _query_segment(self, q: dict[str, str]) -> Answer:
        name = q.get("segment", "")
        seg = self.view.segment(name)
        if seg is None:
            err = {"success": False, "error_code": SEGMENT_NOT_FOUND, "error_message": name}
            return _json(404, err)
        used, cap = seg["allocator_used_bytes"], seg["allocator_capacity_bytes"]
        return _text([name, f"Used(bytes): {used}", f"Capacity(bytes) : {cap}"])

    def _segments_detail(self, _q: dict[str, str]) -> Answer:
        segs = self.view.segments()
        return _json(200, {"total_segments": len(segs), "segments": segs})

    def _query_key(self, q: dict[str, str]) -> Answer:
        replicas = self.view.replicas(q.get("key", ""))
        if replicas is None:
            err = {
                "success": False,
                "error_code": OBJECT_NOT_FOUND,
                "error_message": "OBJECT_NOT_FOUND",
            }
            return _json(404, err)
        return _json(200, {"success": True, "data": replicas})

    def _batch_query_keys(self, q: dict[str, str]) -> Answer:
        keys = [k for k in q.get("keys", "").split(",") if k]
        if not keys:
            return _json(400, {"success": False, "error": "keys: give key1,key2,..."})
        data: dict[str, Any] = {}
        for key in keys:
            replicas = self.view.replicas(key)
            data[key] = (
                {"ok": True, "values": replicas}
                if replicas is not None
                else {"ok": False, "error": "OBJECT_NOT_FOUND"}
            )
        return _json(200, {"success": True, "data": data})


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class AdminServer:
    """`AdminRoutes` on http://host:port (0 = any free port; the real one after `start`),
    served on a thread; `stop` closes the socket."""

    def __init__(self, routes: AdminRoutes, *, host: str = "127.0.0.1", port: int = 0):
        self.routes, self.host, self.port = routes, host, port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve; raises OSError when the port is taken."""
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    status, ctype, body = routes.answer(self.path)
                except Exception:
                    log.exception("admin: %s failed", self.path)
                    status, ctype, body = 500, TEXT, b"internal error\n"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

        server_cls = _V6Server if ":" in self.host else ThreadingHTTPServer  # "::" is IPv6
        self._server = server_cls((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="master-admin", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
