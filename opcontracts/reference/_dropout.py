"""Dropout bit masks in the kernels' layout: ``torch_npu._npu_dropout_gen_mask`` and the mask
fusion attention draws for ``keep_prob`` < 1.

The layout is op-plugin's (``op_plugin/ops/opapi/DropoutGenMaskKernelNpuOpApi.cpp``,
``FlashAttentionKernelNpuOpApi.cpp``): a uint8 tensor of ``ceil(numels / 128) * 16`` bytes
(the element count rounded up to 128 bits), element ``i``'s bit at bit ``i % 8`` of byte
``i // 8`` (little-endian bit order: op-plugin's tests unpack it with
``np.unpackbits(..., bitorder='little')``); a set bit keeps the element, ``p`` is the
probability of dropping it.  The kernel draws the bits from Philox at ``(seed, offset)``
(``aclnnDropoutGenMaskV2``); the hardware's Philox stream is not public, so these bits are a
stream of our own, deterministic in ``(seed, offset)``: the same seed and offset give the same
mask, wherever it is drawn (``_npu_dropout_gen_mask`` and fusion attention's forward and
backward agree, as on the NPU), but not the NPU's bits.  Bits past ``numels`` are 0.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

__all__ = ["DATA_ALIGN", "_npu_dropout_gen_mask", "keep_mask", "mask_bytes", "mask_length"]

DATA_ALIGN = 128
"""Bits the mask's length is rounded up to (op-plugin's ``DATA_ALIGN``)."""

_BIT_WEIGHTS = tuple(1 << b for b in range(8))


def mask_length(numels: int) -> int:
    """Bytes of the mask of ``numels`` elements: ``ceil(numels / 128) * 128 / 8``."""
    return (int(numels) + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN // 8


def _generator(seed: int, offset: int) -> torch.Generator:
    digest = hashlib.blake2b(struct.pack("<QQ", int(seed) & (2**64 - 1),
                                         int(offset) & (2**64 - 1)), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def mask_bytes(numels: int, p: float, seed: int, offset: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The uint8 mask of ``numels`` elements, each kept with probability ``1 - p``."""
    numels = int(numels)
    keep = torch.rand(numels, generator=_generator(seed, offset)) >= float(p)
    bits = torch.zeros(mask_length(numels) * 8, dtype=torch.uint8)
    bits[:numels] = keep.to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32)
    packed = (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    return packed.to(device)


def keep_mask(mask: torch.Tensor, numels: int) -> torch.Tensor:
    """The first ``numels`` bits of a uint8 ``mask`` as a bool tensor (True: kept); bits the
    mask does not have (a mask too short) read as dropped."""
    flat = mask.reshape(-1).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
    if bits.numel() < numels:
        bits = torch.cat([bits, bits.new_zeros(numels - bits.numel())])
    return bits[:numels]


def _npu_dropout_gen_mask(self: torch.Tensor, size: Sequence[int], p: float, seed: int,
                          offset: int, *, parallel: bool | None = True,
                          sync: bool | None = None) -> torch.Tensor:
    """The mask of ``prod(size)`` elements at ``(seed, offset)`` on ``self``'s device
    (``self`` gives the device and, on the NPU, the probability's dtype; ``parallel`` and
    ``sync`` choose the stream the kernel runs on, nothing in the result)."""
    numels = 1
    for s in size:
        numels *= int(s)
    return mask_bytes(numels, p, seed, offset, self.device)
