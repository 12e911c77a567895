"""Upstream's reads and writes of parts of values, over our Store: a value gathered from
several buffers (`put_multi`, batch_put_from_multi_buffers), scattered into several
(`get_multi`, batch_get_into_multi_buffers), and byte ranges of values into buffers
(`get_ranges`, get_into_ranges). Each is one metadata round trip for the whole batch,
then one batch of one-sided transfers between the caller's registered memory and the
replicas, a request per part.

A fragment is (local segment, offset in it, replica, offset in the value, bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mooncake.errors import MooncakeError, TransferError
from mooncake.store.client.client import Store
from mooncake.store.metadata.objects import ReplicaDesc
from mooncake.store.node.node import remote_name
from mooncake.store.upstream.buffers import AddressBook
from mooncake.store.upstream.codes import ErrorCode, code_of, code_of_put, code_of_status
from mooncake.transfer.types import TransferOp, TransferRequest, TransferState

log = logging.getLogger(__name__)

Fragment = tuple[str, int, ReplicaDesc, int, int]
BAD: int = int(ErrorCode.INVALID_PARAMS)


def move(store: Store, op: TransferOp, frags: Sequence[Fragment]) -> list[str]:
    """Move every fragment in one batch; per fragment "" (done) or why it failed."""
    reqs = [
        TransferRequest(
            op, seg, off, remote_name(d.segment, d.endpoint), d.offset + at, size, d.token
        )
        for seg, off, d, at, size in frags
    ]
    if not reqs:
        return []
    try:
        statuses = store.engine.transfer(reqs, store.timeout_s).poll()
    except TransferError as e:
        return [str(e)] * len(reqs)
    return [
        "" if st.state is TransferState.DONE else f"{st.state.value}: {st.reason}"
        for st in statuses
    ]


def _parts(
    book: AddressBook, ptrs: Sequence[int], sizes: Sequence[int]
) -> list[tuple[str, int, int]]:
    """(segment, offset, bytes) of each registered part; ValueError when one is not."""
    if len(ptrs) != len(sizes) or not ptrs or any(n <= 0 for n in sizes):
        raise ValueError(f"{len(ptrs)} buffers with {len(sizes)} sizes {list(sizes)[:4]}...")
    return [(*book.resolve(p, n)[:2], n) for p, n in zip(ptrs, sizes, strict=True)]


def put_multi(
    store: Store,
    book: AddressBook,
    keys: Sequence[str],
    all_ptrs: Sequence[Sequence[int]],
    all_sizes: Sequence[Sequence[int]],
    opts: dict[str, Any],
) -> list[int]:
    """Store keys[i] as the concatenation of its parts; a code per key."""
    out = [BAD] * len(keys)
    if not len(keys) == len(all_ptrs) == len(all_sizes):
        return out
    by_size: dict[int, list[int]] = {}  # value bytes -> indices (start_puts takes one size)
    parts: dict[int, list[tuple[str, int, int]]] = {}
    for i, (ptrs, sizes) in enumerate(zip(all_ptrs, all_sizes, strict=True)):
        try:
            parts[i] = _parts(book, ptrs, sizes)
        except ValueError as e:
            log.warning("batch_put_from_multi_buffers: %r: %s", keys[i], e)
            continue
        by_size.setdefault(sum(sizes), []).append(i)
    for size, idx in by_size.items():
        try:
            starts = store.start_puts([keys[i] for i in idx], size, **opts)
        except MooncakeError as e:
            for i in idx:
                out[i] = code_of(e)
            continue
        frags: list[Fragment] = []
        owner: list[int] = []  # the index of each fragment's key
        for i, r in zip(idx, starts, strict=True):
            out[i] = code_of_put(r.status)
            if r.status != "ok":
                continue
            for d in r.replicas:
                at = 0
                for seg, off, n in parts[i]:
                    frags.append((seg, off, d, at, n))
                    owner.append(i)
                    at += n
        failed = {
            i for i, why in zip(owner, move(store, TransferOp.WRITE, frags), strict=True) if why
        }
        written = [(i, r) for i, r in zip(idx, starts, strict=True) if r.status == "ok"]
        if failed:
            store.revoke_puts([keys[i] for i, _ in written if i in failed])
        done = [(i, r) for i, r in written if i not in failed]
        ends = store.end_puts([keys[i] for i, _ in done], [r.replicas for _, r in done])
        for (i, _), end in zip(done, ends, strict=True):
            out[i] = code_of_put(end.status)
        for i in failed:
            out[i] = int(ErrorCode.TRANSFER_FAIL)
    return out


def get_multi(
    store: Store,
    book: AddressBook,
    keys: Sequence[str],
    all_ptrs: Sequence[Sequence[int]],
    all_sizes: Sequence[Sequence[int]],
) -> list[int]:
    """Read keys[i] into its buffers in order, filling each before the next; per key the
    bytes read or a negative code (its buffers together smaller than the value: -600)."""
    out = [BAD] * len(keys)
    if not len(keys) == len(all_ptrs) == len(all_sizes) or not keys:
        return out
    try:
        found = store.locate_batch(keys)
    except MooncakeError as e:
        return [code_of(e)] * len(keys)
    frags: list[Fragment] = []
    owner: list[int] = []
    for i, r in enumerate(found):
        if r.status != "ok" or not r.replicas:
            out[i] = code_of_status("error" if r.status == "ok" else r.status)
            continue
        try:
            parts = _parts(book, all_ptrs[i], all_sizes[i])
        except ValueError as e:
            log.warning("batch_get_into_multi_buffers: %r: %s", keys[i], e)
            continue
        if sum(n for _, _, n in parts) < r.size:
            log.warning(
                "batch_get_into_multi_buffers: %r is %d bytes, more than its buffers",
                keys[i],
                r.size,
            )
            continue
        at = 0
        for seg, off, n in parts:
            if at >= r.size:
                break
            frags.append((seg, off, r.replicas[0], at, min(n, r.size - at)))
            owner.append(i)
            at += n
        out[i] = r.size
    for i, why in zip(owner, move(store, TransferOp.READ, frags), strict=True):
        if why:
            log.warning("batch_get_into_multi_buffers: %r: %s", keys[i], why)
            out[i] = int(ErrorCode.TRANSFER_FAIL)
    return out


def get_ranges(
    store: Store,
    book: AddressBook,
    buffer_ptrs: Sequence[int],
    all_keys: Sequence[Sequence[str]],
    all_dst: Sequence[Sequence[Sequence[int]]],
    all_src: Sequence[Sequence[Sequence[int]]],
    all_sizes: Sequence[Sequence[Sequence[int]]],
) -> list[list[list[int]]]:
    """results[i][j][k]: bytes read of fragment k of key j into buffer i, or a negative
    code (shapes that do not match, a range outside the value or the buffer, a miss)."""
    if not len(buffer_ptrs) == len(all_keys) == len(all_dst) == len(all_src) == len(all_sizes):
        return [[[BAD] for _ in keys] for keys in all_keys]
    wanted = list(dict.fromkeys(k for keys in all_keys for k in keys))
    try:
        located = {r.key: r for r in store.locate_batch(wanted)} if wanted else {}
    except MooncakeError as e:
        return [[[code_of(e)] for _ in keys] for keys in all_keys]
    out: list[list[list[int]]] = []
    frags: list[Fragment] = []
    slots: list[tuple[int, int, int]] = []  # (i, j, k) of each fragment
    for i, ptr in enumerate(buffer_ptrs):
        out.append([])
        try:
            seg, base, room = book.resolve(ptr, 1)
        except ValueError:
            seg, base, room = "", 0, 0
        for j, key in enumerate(all_keys[i]):
            dst, src, sizes = _row(all_dst, i, j), _row(all_src, i, j), _row(all_sizes, i, j)
            if not len(dst) == len(src) == len(sizes):
                out[i].append([BAD] * len(dst))
                continue
            r = located[key]
            row: list[int] = []
            for k, (d, s, n) in enumerate(zip(dst, src, sizes, strict=True)):
                if r.status != "ok" or not r.replicas:
                    row.append(code_of_status("error" if r.status == "ok" else r.status))
                elif not seg or n <= 0 or d < 0 or s < 0 or d + n > room or s + n > r.size:
                    row.append(BAD)
                else:
                    frags.append((seg, base + d, r.replicas[0], s, n))
                    slots.append((i, j, k))
                    row.append(n)
            out[i].append(row)
    for (i, j, k), why in zip(slots, move(store, TransferOp.READ, frags), strict=True):
        if why:
            out[i][j][k] = int(ErrorCode.TRANSFER_FAIL)
    return out


def _row(table: Sequence[Sequence[Sequence[int]]], i: int, j: int) -> Sequence[int]:
    return table[i][j] if j < len(table[i]) else ()
