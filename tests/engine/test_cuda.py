"""On a GPU node (marker `gpu`, skipped elsewhere: see tests/conftest.py): CUDA memory
named by raw address, as vLLM's MooncakeConnector passes its KV cache tensors' data_ptr()."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_cuda_pointers_are_recognised_and_moved(engine):
    """A torch CUDA tensor's data_ptr() registers as device memory (SUPPORT_CUDA true);
    writes from it to a peer's host buffer and reads back into it land byte for byte."""
    import torch

    import mooncake.engine as engine_module
    from mooncake.engine.pointers import cuda_device_of

    assert engine_module.SUPPORT_CUDA is True
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    assert cuda_device_of(src.data_ptr()) == src.device.index
    host = np.zeros(src.numel(), dtype=np.uint8)
    back = torch.zeros_like(src)
    assert (
        engine.batch_register_memory([src.data_ptr(), back.data_ptr()], [src.numel(), back.numel()])
        == 0
    )
    assert engine.register_memory(host.ctypes.data, host.nbytes) == 0
    me = f"127.0.0.1:{engine.get_rpc_port()}"
    torch.cuda.synchronize()
    assert engine.transfer_sync_write(me, src.data_ptr(), host.ctypes.data, src.numel()) == 0
    assert np.array_equal(host, src.cpu().numpy())
    assert engine.transfer_sync_read(me, back.data_ptr(), host.ctypes.data, src.numel()) == 0
    assert torch.equal(back, src)
