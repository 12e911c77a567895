"""The soak's parts on their own: the looped arrivals, which error kinds are clear, the
deck of fault kinds, and RSS growth judged on real processes."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from mooncake.bench.soak.faults import KINDS, Deck
from mooncake.bench.soak.rss import RssSampler
from mooncake.bench.soak.run import arrivals, is_clear
from mooncake.sim.trace import TraceRecord


def _rec(ms: int) -> TraceRecord:
    return TraceRecord(ms, 64, 8, [0, 1])


def test_arrivals_loop_the_trace_with_a_gap_and_stop_at_the_duration() -> None:
    """Three records over 2 s at speed 2 (1 s span): loops of 1 + 1/3 s, cut at 3 s."""
    times = arrivals([_rec(0), _rec(1000), _rec(2000)], speed=2.0, duration_s=3.0)
    period = 1.0 + 1.0 / 3
    assert times == [0.0, 0.5, 1.0, period, period + 0.5, period + 1.0, 2 * period]
    assert arrivals([_rec(5)], speed=1.0, duration_s=0.35) == [0.0, 0.1, 0.2, 0.30000000000000004]


def test_clear_errors_name_what_happened_and_the_rest_do_not() -> None:
    for kind in (
        "connect",
        "disconnected",
        "http 502 unavailable",
        "http 503 server_error",
        "stream unavailable",
        "stream server_error",
    ):
        assert is_clear(kind), kind
    for kind in (
        "",
        "hung",
        "ended early",
        "bad data",
        "timeout",
        "http 500 server_error",
        "stream",
    ):
        assert not is_clear(kind), kind


def test_the_deck_deals_every_kind_before_any_twice() -> None:
    deck = Deck(KINDS, random.Random(3))
    first, second = [deck.deal() for _ in KINDS], [deck.deal() for _ in KINDS]
    assert sorted(first) == sorted(KINDS) == sorted(second)


@pytest.mark.cluster
def test_rss_growth_after_warm_up_flags_a_growing_process_not_a_steady_one() -> None:
    """A child that allocates 4 MiB more every 0.1 s grows; one that sleeps does not; a
    sample before the warm-up (the interpreter starting) is not judged."""
    grow = "import time\nb=[]\nwhile True:\n  b.append(bytearray(4<<20)); time.sleep(0.1)"
    procs = {
        "grows": subprocess.Popen([sys.executable, "-c", grow]),
        "steady": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
    }
    sampler = RssSampler(warmup_s=0.5)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < 2.5:
            sampler.sample(t, {name: p.pid for name, p in procs.items()})
            time.sleep(0.1)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    report = {p.name: p for p in sampler.report()}
    grows, steady = report["grows"], report["steady"]
    assert grows.anon_growth is not None and grows.anon_growth > 0.2, grows.anon_growth
    assert grows.rss_growth is not None and grows.rss_growth > 0.2
    assert steady.rss_growth is not None and abs(steady.rss_growth) < 0.05, steady.rss_growth
    assert grows.samples[0][0] < 0.5 and grows.peak_rss_bytes > 40 << 20
