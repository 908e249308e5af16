"""Dtype names and aliases to ``torch.dtype``, and the cast rules used by ``fix`` mode."""

from __future__ import annotations

import torch

__all__ = ["parse_dtype", "dtype_name", "short_name", "is_floating", "int_range"]

_CANONICAL: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        _CANONICAL[_n] = getattr(torch, _n)

_ALIASES: dict[str, str] = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64", "f64": "float64",
    "i8": "int8", "u8": "uint8", "i16": "int16", "short": "int16",
    "i32": "int32", "int": "int32", "i64": "int64", "long": "int64",
    "boolean": "bool",
}

_SHORT: dict[torch.dtype, str] = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
}

_NAME_OF: dict[torch.dtype, str] = {v: k for k, v in _CANONICAL.items()}


def known_names() -> list[str]:
    return sorted(set(_CANONICAL) | set(_ALIASES))


def parse_dtype(value: object) -> torch.dtype:
    """Turn ``"bf16"``, ``"torch.bfloat16"``, ``"bfloat16"`` or a ``torch.dtype`` into a ``torch.dtype``.

    Raises ``ValueError`` naming the known spellings when the name is unknown.
    """
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a dtype name or torch.dtype, got {type(value).__name__} {value!r}")
    key = value.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    key = _ALIASES.get(key, key)
    try:
        return _CANONICAL[key]
    except KeyError:
        raise ValueError(
            f"unknown dtype {value!r}; known names: {', '.join(known_names())}"
        ) from None


def dtype_name(dt: torch.dtype) -> str:
    """Canonical name without the ``torch.`` prefix (``bfloat16``)."""
    return _NAME_OF.get(dt, str(dt).replace("torch.", ""))


def short_name(dt: torch.dtype) -> str:
    """Short name used in tables (``bf16``), or the canonical one."""
    return _SHORT.get(dt, dtype_name(dt))


def is_floating(dt: torch.dtype) -> bool:
    return dt.is_floating_point


def int_range(dt: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dt)
    return int(info.min), int(info.max)
