"""What a simulated instance sees of the simulation it runs in.

`SimContext` is the part of the `Simulator` (`sim/simulator.py`) that the prefill, decode
and coupled instances call: its settings and cost model, the Conductor and network they
report to, the event heap, and the request's next step (prefill finished, decode
finished, rejected). The Simulator satisfies it, so the instances never import the
simulator that builds them; `Waiter` and `DecodeRoom` are how a prefill group and a
decode instance see each other (waiting for KV room), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mooncake.conductor.conductor import Conductor
    from mooncake.conductor.costmodel import CostModel
    from mooncake.conductor.misses import MissLedger
    from mooncake.conductor.network import NetworkState
    from mooncake.sim.cluster import SimConfig
    from mooncake.sim.metrics import SimRequest


class Waiter(Protocol):
    """A prefill group waiting for KV room on a decode instance."""

    def wake(self, t: float) -> None:
        """Try to start the next request again at `t`."""
        ...


class DecodeRoom(Protocol):
    """A decode instance as a prefill group sees it: room for a prompt's KV, reserved
    before the prefill starts, and the groups waiting for some."""

    waiters: set[Waiter]

    def try_reserve(self, t: float, req: SimRequest) -> bool: ...


class SimContext(Protocol):
    """The simulation as its instances see it (the `Simulator` satisfies it)."""

    cfg: SimConfig
    cost: CostModel
    conductor: Conductor
    network: NetworkState
    ledger: MissLedger
    block_tokens: int
    tbt_slo_s: float
    tbt_share: float
    num_layers: int
    gap_runs: list[tuple[float, int]] | None

    @property
    def decode(self) -> Mapping[str, DecodeRoom]: ...

    def push(self, t: float, fn: Callable[[float, Any], None], arg: Any) -> None: ...

    def compute_factor(self, kind: str, starting: int = 0) -> float: ...

    def host_changed(self, t: float) -> None: ...

    def prefill_finished(self, req: SimRequest, t: float) -> None: ...

    def decode_finished(self, req: SimRequest, t: float) -> None: ...

    def rejected_at_start(self, req: SimRequest, t: float) -> None: ...

    def rejected_late(self, req: SimRequest, t: float) -> None: ...
