"""The emulated NPU generator's Philox state: a seed and an offset, as torch_npu keeps them.

torch_npu's ``NPUGeneratorImpl`` (``torch_npu/csrc/aten/NPUGeneratorImpl.cpp``) holds a seed
and a Philox offset.  The kernels that draw their own random bits (fusion attention's dropout)
take ``(seed, offset)`` from it through ``philox_engine_inputs(increment)``: the current
offset, then the offset advances by the increment rounded up to a multiple of 4.
``manual_seed`` sets the seed and resets the offset to 0; its state is 16 bytes (the seed as
uint64, the offset as int64).  The default seed is ``c10::default_rng_seed_val``.

So after ``torch.npu.manual_seed(s)`` the first fusion attention with dropout draws ``(s, 0)``,
the mask ``torch_npu._npu_dropout_gen_mask(x, size, p, seed=s, offset=0)`` gives: op-plugin's
tests build their golden that way.  The bits of the mask are the emulation's own stream
(``opcontracts.reference._dropout``), not the hardware's.  The other random npu ops of the
emulation run on the CPU generator (``_device``); ``_npu_api.get_rng_state`` saves both.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_SEED", "DRAWS", "STATE_BYTES", "engine_inputs", "get_state", "manual_seed",
           "set_state"]

DEFAULT_SEED = 67280421310721
"""``c10::default_rng_seed_val``: an NPU generator's seed before any ``manual_seed``."""

STATE_BYTES = 16
"""The size of the generator's state (seed uint64, offset int64), as torch_npu's."""

_lock = threading.Lock()
_state = {"seed": DEFAULT_SEED, "offset": 0}


def manual_seed(seed: int) -> None:
    """``set_current_seed``: the seed, and the offset back to 0."""
    with _lock:
        _state["seed"] = int(seed) & 0xFFFFFFFFFFFFFFFF
        _state["offset"] = 0


def engine_inputs(increment: int) -> tuple[int, int]:
    """``philox_engine_inputs``: (seed, offset) for one kernel; the offset advances by
    ``increment`` rounded up to a multiple of 4."""
    with _lock:
        seed, offset = _state["seed"], _state["offset"]
        _state["offset"] = offset + (int(increment) + 3) // 4 * 4
        return seed, offset


def get_state() -> bytes:
    """The 16-byte state: the seed (uint64) and the offset (int64), little-endian."""
    with _lock:
        return struct.pack("<Qq", _state["seed"], _state["offset"])


def set_state(data: bytes) -> None:
    """A state from :func:`get_state`; 8 bytes set the seed alone (offset 0), as torch_npu's
    ``set_state`` accepts.  Any other size is torch_npu's "RNG state is wrong size"."""
    if len(data) == 8:
        manual_seed(struct.unpack("<Q", data)[0])
        return
    if len(data) != STATE_BYTES:
        raise RuntimeError(f"RNG state is wrong size: {len(data)} bytes, expected {STATE_BYTES} "
                           "(the NPU generator's seed and offset)")
    seed, offset = struct.unpack("<Qq", data)
    if offset % 4:
        raise RuntimeError("offset must be a multiple of 4")
    with _lock:
        _state["seed"], _state["offset"] = seed, offset


_EPSILON = 1e-9  # op-plugin's get_dropout_status


def _fusion_attention_draw(args: dict[str, Any]) -> None:
    """op-plugin ``dropout_gen_mask`` (FlashAttentionKernelNpuOpApi.cpp): with 0 < keep_prob < 1
    and no ``dropout_mask`` given, the glue takes ``philox_engine_inputs(10)`` and the kernel's
    mask is the one drawn at that seed and offset (the forward returns them); with a mask given,
    the caller's ``seed`` / ``offset`` stand."""
    keep_prob = float(args["keep_prob"])
    if abs(keep_prob - 1.0) < _EPSILON or abs(keep_prob) < _EPSILON:
        return
    if args.get("dropout_mask") is not None:
        return
    args["seed"], args["offset"] = engine_inputs(10)


DRAWS: dict[str, Callable[[dict[str, Any]], None]] = {
    "npu_fusion_attention": _fusion_attention_draw,
    "npu_fusion_attention_v2": _fusion_attention_draw,
    "npu_fusion_attention_v3": _fusion_attention_draw,
}
"""Per emulated op, what its glue draws from the generator (it sets the bound arguments)."""
