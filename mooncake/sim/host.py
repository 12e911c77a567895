"""CPU shares on one shared host: how much slower a node computes when the local cluster's
nodes share a few cores (`mooncake up --local`), with their nice values.

Linux's fair scheduler gives runnable tasks CPU time in proportion to their weights
(nice 0 weighs 1024 and each nice level is 1.25 times lighter: `sched_prio_to_weight`
in the kernel's `kernel/sched/core.c`), and a single-threaded process never uses more
than one core. So the shares are a water-filling: split the cores by weight, give a
process that would get more than it can use its cap, and split the rest again among
the others. `up --local` runs its prefill nodes at nice 10 when compute nodes outnumber
the cores: a busy decode node then keeps a core to itself, and the prefill stages share
what is left with the control plane.
"""

from __future__ import annotations

from collections.abc import Sequence

NICE_0_WEIGHT = 1024.0


def nice_weight(nice: int) -> float:
    """The scheduler weight of a task at `nice` (-20..19), as the kernel's table has it
    to within its rounding."""
    if not -20 <= nice <= 19:
        raise ValueError(f"nice must be in -20..19, got {nice}")
    return NICE_0_WEIGHT / 1.25**nice


def core_shares(demands: Sequence[tuple[float, float]], cores: float) -> list[float]:
    """The cores each runnable entity gets: `demands` holds (weight, cap) per entity (a
    cap is the most cores it can use: 1 for a single-threaded process)."""
    shares = [0.0] * len(demands)
    left = cores
    open_ = [i for i, (w, cap) in enumerate(demands) if w > 0 and cap > 0]
    while open_ and left > 1e-12:
        total = sum(demands[i][0] for i in open_)
        capped = [i for i in open_ if left * demands[i][0] / total >= demands[i][1]]
        if not capped:
            for i in open_:
                shares[i] = left * demands[i][0] / total
            break
        for i in capped:
            shares[i] = demands[i][1]
            left -= demands[i][1]
        open_ = [i for i in open_ if i not in capped]
    return shares


def slowdown(
    kind: str,
    cores: float,
    *,
    prefill_busy: int,
    decode_busy: int,
    background_cores: float = 0.0,
    prefill_nice: int = 0,
    prefill_cpu: float = 1.0,
    decode_cpu: float = 1.0,
    decode_duty: float = 1.0,
) -> float:
    """The slowdown factor (>= 1) of one `kind` ("prefill" or "decode") process on a host
    of `cores`, with `prefill_busy` prefill stages and `decode_busy` decode nodes running
    (the one asked about among them, or counted as starting), and `background_cores` of
    nice-0 control-plane work (API, master, store nodes). A busy node wants `prefill_cpu`
    or `decode_cpu` cores (its compute thread and the threads around it: KV stream,
    copies, links; 1 = one single-threaded process); it is slowed by what it wants over
    what it gets. A paced decode node (decode.step_interval_s) computes `decode_duty` of
    its time: the others see that share of its demand; it competes in full while it
    steps."""
    if cores <= 0:
        return 1.0
    if kind == "prefill":
        prefill_busy = max(prefill_busy, 1)
    elif kind == "decode":
        decode_busy = max(decode_busy, 1)
    else:
        raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    demands = [(nice_weight(prefill_nice) * prefill_cpu, prefill_cpu)] * prefill_busy
    duty = 1.0 if kind == "decode" else decode_duty
    demands += [(NICE_0_WEIGHT * decode_cpu * duty, decode_cpu * duty)] * decode_busy
    if background_cores > 0:
        demands.append((NICE_0_WEIGHT * background_cores, background_cores))
    share = core_shares(demands, cores)[0 if kind == "prefill" else prefill_busy]
    want = prefill_cpu if kind == "prefill" else decode_cpu
    return max(1.0, want / share) if share > 0 else float("inf")
