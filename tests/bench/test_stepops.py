"""A decode step's ops and host syncs (bench/stepops.py): through the Triton backend (in
Triton's interpreter without a GPU) the ops dispatched do not grow with the batch or the
block scatter, and the only host sync is the read of the sampled ids; the counter itself
catches the syncs it claims to."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the engine tests need torch")
import torch  # noqa: E402

if not torch.cuda.is_available():  # NOTE: before triton's import, which reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton backend needs triton")

from mooncake.bench.stepops import count, decode_step_counts  # noqa: E402


def test_decode_step_ops_constant_in_batch_and_one_sync() -> None:
    counts = decode_step_counts([1, 8, 32], backend="triton")
    ops = {b: c["ops"] for b, c in counts.items()}
    assert len(set(ops.values())) == 1, ops
    for b, c in counts.items():
        assert c["syncs"] <= 1, (b, c["sync_sites"])


def test_torch_backend_grows_with_the_batch() -> None:
    """The reference backend loops over sequences: the counter sees it."""
    counts = decode_step_counts([1, 8], backend="torch")
    assert counts["8"]["ops"] > counts["1"]["ops"]


def test_counter_sees_host_reads_and_dispatched_ops() -> None:
    t = torch.arange(6.0)

    def work() -> None:
        u = (t * 2).sum()
        u.item()
        t.tolist()
        bool(t[0] > 1)
        torch.nonzero(t)

    c = count(work)
    assert c.syncs["Tensor.item"] == 1 and c.syncs["Tensor.tolist"] == 1
    assert c.syncs["Tensor.__bool__"] == 1 and c.syncs["aten.nonzero"] == 1
    assert c.ops["aten.mul"] == 1 and c.ops["aten.sum"] == 1
    assert c.num_syncs == 4


@pytest.mark.cluster
def test_decode_step_ops_per_rank_constant_at_two_ranks() -> None:
    """Tensor parallel over 2 ranks (a follower process): rank 0's step still dispatches
    the same ops at every batch size (the collectives a constant few per layer)."""
    counts = decode_step_counts([1, 8], backend="triton", tensor_parallel=2)
    assert counts["1"]["ops"] == counts["8"]["ops"], counts
    assert all(c["syncs"] <= 1 for c in counts.values()), counts
