"""ggml's block quantizations decoded in torch, vectorized over all blocks of a tensor.

`dequantize(raw, type_name, shape)` turns a tensor's bytes (a uint8 tensor, e.g. a view of
a memory-mapped GGUF file) into float32 values equal to the `gguf` package's
`gguf.quants.dequantize` (same arithmetic in the same order, checked bit for bit by the
tests). Each type's block layout, in bytes (`d`, `m`, `dmin` are float16 scales):

| type | elems | layout                                                                  |
|------|------:|-------------------------------------------------------------------------|
| Q8_0 | 32    | d, 32 x int8                                  x = d * q                 |
| Q4_0 | 32    | d, 16 x (lo nibble: x[i], hi: x[i + 16])      x = d * (q - 8)           |
| Q4_1 | 32    | d, m, nibbles as Q4_0                         x = d * q + m             |
| Q5_0 | 32    | d, qh u32 (bit i: 5th bit of x[i]), nibbles   x = d * (q - 16)          |
| Q5_1 | 32    | d, m, qh, nibbles                             x = d * q + m             |
| Q4_K | 256   | d, dmin, 12 B of 6-bit scales/mins (8 sub-blocks of 32), 128 B nibbles  |
| Q5_K | 256   | as Q4_K plus 32 B of 5th bits (bit j of byte i: x[32 j + i])            |
| Q6_K | 256   | 128 B low nibbles, 64 B 2-bit highs, 16 x int8 scales, d (16 x 16)      |

The work is a few elementwise passes over the tensor (torch's intra-op threads apply),
where the `gguf` package runs numpy over groups of 16 rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

QK_K = 256  # elements per super-block of the K quants
# type name -> (elements, bytes) per block, for the types decoded here
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def dequantize(
    raw: Tensor, type_name: str, shape: tuple[int, ...], out: Tensor | None = None
) -> Tensor:
    """`raw` (uint8 bytes of one tensor) as float32 values of `shape` (numpy order), written
    into `out` (a contiguous float32 tensor of that many elements) when given.

    Float types come back as a view of `raw` or one conversion when `out` is None.
    """
    elems, nbytes = BLOCKS[type_name]
    numel = math.prod(shape)
    assert raw.dtype == torch.uint8 and raw.numel() == numel // elems * nbytes, (
        type_name,
        shape,
        raw.shape,
    )
    assert out is None or (out.is_contiguous() and out.numel() == numel), (shape, out)
    if type_name in ("F32", "F16", "BF16"):
        value = raw.view(_FLOATS[type_name]).view(shape)
        return value.float() if out is None else out.view(shape).copy_(value)
    if out is None:
        out = torch.empty(shape)
    blocks, values = raw.view(-1, nbytes), out.view(-1, elems)  # (num_blocks, ...)
    decode, step = _DECODERS[type_name], max(1, _CHUNK_ELEMS // elems)
    for i in range(0, blocks.shape[0], step):  # NOTE: chunks keep the temporaries in cache
        decode(blocks[i : i + step], values[i : i + step])
    return out.view(shape)


_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK_ELEMS = 1 << 16  # values decoded per pass


def _f16(blocks: Tensor, at: int) -> Tensor:
    """(num_blocks, 1) float32: the float16 stored at byte `at` of each block."""
    return blocks[:, at : at + 2].view(torch.float16).float()


def _put_nibbles(qs: Tensor, out: Tensor) -> None:
    """(n, k) bytes -> out (n, 2k): the low nibbles, then the high ones."""
    k = qs.shape[-1]
    out[..., :k] = qs & 0x0F
    out[..., k:] = qs >> 4


def _bits(qh: Tensor) -> Tensor:
    """(n, k) bytes -> (n, 8k) 0/1: bit j of byte i at index 8 i + j (little-endian)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q8_0(b: Tensor, out: Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8)).mul_(_f16(b, 0))


def _q4_0(b: Tensor, out: Tensor) -> None:
    _put_nibbles(b[:, 2:], out)
    out.sub_(8).mul_(_f16(b, 0))  # NOTE: small integers: exact in float32, as gguf's int8


def _q4_1(b: Tensor, out: Tensor) -> None:
    _put_nibbles(b[:, 4:], out)
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b: Tensor, at: int, out: Tensor) -> None:
    """out (n, 32): 5-bit values; the 4 bytes of high bits start at `at`."""
    qs = b[:, at + 4 :]
    high = _bits(b[:, at : at + 4]) << 4
    out[:, :16] = (qs & 0x0F) | high[:, :16]
    out[:, 16:] = (qs >> 4) | high[:, 16:]


def _q5_0(b: Tensor, out: Tensor) -> None:
    _q5(b, 2, out)
    out.sub_(16).mul_(_f16(b, 0))


def _q5_1(b: Tensor, out: Tensor) -> None:
    _q5(b, 4, out)
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """(n, 12) packed 6-bit scales and mins of 8 sub-blocks -> two (n, 8, 1) float32.

    Bytes 0-3: scales 0-3 (low 6 bits), high 2 bits of scales 4-7; bytes 4-7: mins 0-3,
    high 2 bits of mins 4-7; bytes 8-11: low nibble scales 4-7, high nibble mins 4-7.
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    low = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scale.float().unsqueeze(-1), low.float().unsqueeze(-1)


def _k_nibbles(qs: Tensor, out: Tensor) -> None:
    """(n, 128) bytes -> out (n, 4, 2, 32): per 32-byte group, its low nibbles then high."""
    g = qs.view(-1, 4, 32)
    out[:, :, 0] = g & 0x0F
    out[:, :, 1] = g >> 4


def _k_finish(b: Tensor, q: Tensor) -> None:
    """q (n, 8, 32) quants -> d * scale * q - dmin * min, in place."""
    scale, low = _k_scales(b[:, 4:16])
    q.mul_(_f16(b, 0).unsqueeze(-1) * scale).sub_(_f16(b, 2).unsqueeze(-1) * low)


def _q4_k(b: Tensor, out: Tensor) -> None:
    _k_nibbles(b[:, 16:], out.view(-1, 4, 2, 32))
    _k_finish(b, out.view(-1, 8, 32))


def _q5_k(b: Tensor, out: Tensor) -> None:
    q = out.view(-1, 8, 32)
    _k_nibbles(b[:, 48:], out.view(-1, 4, 2, 32))
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    q.add_(high << 4)  # NOTE: the 5th bit is clear in the nibbles, so + is |
    _k_finish(b, q)


def _q6_k(b: Tensor, out: Tensor) -> None:
    ql = b[:, :128].view(-1, 2, 1, 64)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).view(-1, 8, 32)
    qh = b[:, 128:192].view(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = out.view(-1, 16, 16)
    q.copy_(((low | ((qh & 0x03).view(-1, 8, 32) << 4)).view(torch.int8) - 32).view(-1, 16, 16))
    d = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()  # (n, 16)
    q.mul_(d.unsqueeze(-1))


_DECODERS: dict[str, Callable[[Tensor, Tensor], None]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
