"""The Conductor (global scheduler): prefix index, cost model, policies, admission.

Pure logic (no sockets, threads or clock), shared by the real master and the simulator
(`mooncake.sim`). Modules: `conductor` (the match -> estimate -> place -> admit loop),
`index` (block hash -> nodes and tiers, fed by store events), `costmodel` (polynomial
prefill / decode-step times, transfer times; the `mooncake profile` file format),
`roofline` (analytic cost model of a GPU type and a model's shape; the master's default
when no profile is configured; the one reader of hardware, through NVML), `network` (bytes
queued per link), `policy` (random, round_robin, load_balance, cache_aware,
kvcache_centric = Algorithm 1), `load` (prefill queue times, decode batches and
reservations), `forecast` (decode times and the §7.4 pool forecast), `tickets` (each
accepted request's load, moved along by progress reports), `placement` (which decode
instance, at arrival and at prefill start), `admission` (early rejection none / basic /
predictive), `types` (settings, requests, decisions).
"""

from mooncake.conductor.conductor import Conductor
from mooncake.conductor.costmodel import CostModel, CostModelError
from mooncake.conductor.index import IndexUpdate, PrefixIndex
from mooncake.conductor.roofline import roofline_cost_model
from mooncake.conductor.types import (
    POLICIES,
    REJECTION_MODES,
    ConductorParams,
    Decision,
    ReplicationOrder,
    ScheduleRequest,
)

__all__ = [
    "POLICIES",
    "REJECTION_MODES",
    "Conductor",
    "ConductorParams",
    "CostModel",
    "CostModelError",
    "Decision",
    "IndexUpdate",
    "PrefixIndex",
    "ReplicationOrder",
    "ScheduleRequest",
    "roofline_cost_model",
]
