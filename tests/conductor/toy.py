"""A cost model with round numbers, so tests can compute the Conductor's choices by hand.

prefill: 1 ms per new token, nothing else; decode step: 10 ms + 1 ms per request + 1 us per
KV token; blocks of 100 tokens of 1 byte each; links of 1000 bytes/s (0.1 s per block).
"""

from mooncake.conductor import Conductor, ConductorParams, CostModel
from mooncake.conductor.costmodel import COST_MODEL_VERSION, CostModelFile, Poly2, Term

BLOCK = 100  # tokens per block


def toy_cost_file(
    kv_capacity_tokens: int = 10_000,
    link_bytes_per_s: float = 1000.0,
    step_per_request_s: float = 1e-3,
    step_per_token_s: float = 1e-6,
    ssd_read_bytes_per_s: float = 2e9,
) -> CostModelFile:
    """The round-number cost model: prefill 1 ms per new token; decode step 10 ms + the
    given per-request and per-KV-token terms; 1 byte of KV per token."""
    return CostModelFile(
        version=COST_MODEL_VERSION,
        model="toy",
        device="toy",
        source="profile",
        kv_bytes_per_token=1,
        kv_capacity_tokens=kv_capacity_tokens,
        link_bytes_per_s=link_bytes_per_s,
        prefill=Poly2(("input_len", "reused_len"), (Term((1, 0), 1e-3), Term((0, 1), -1e-3))),
        decode=Poly2(
            ("batch_size", "context_len"),
            (Term((0, 0), 0.01), Term((1, 0), step_per_request_s), Term((0, 1), step_per_token_s)),
        ),
        ssd_read_bytes_per_s=ssd_read_bytes_per_s,
    )


def toy_cost(kv_capacity_tokens: int = 10_000) -> CostModel:
    return CostModel(toy_cost_file(kv_capacity_tokens))


def toy_conductor(num_prefill: int = 3, num_decode: int = 2, **params) -> Conductor:
    params.setdefault("block_tokens", BLOCK)
    c = Conductor(ConductorParams(**params), toy_cost())
    for i in range(num_prefill):
        c.add_prefill_instance(f"p{i}")
    for i in range(num_decode):
        c.add_decode_instance(f"d{i}", 10_000)
    return c
