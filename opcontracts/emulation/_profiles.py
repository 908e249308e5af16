"""Kernel dtype profiles: which dtypes each emulated NPU kernel reads correctly.

A real NPU kernel does not check dtypes: it reads its input buffers as the dtype it was
compiled for. A *profile* says, per kernel and per tensor argument, which dtypes the kernel
was compiled for. The first dtype listed is the one the kernel *assumes*: an argument in any
other dtype has its bytes read as that first dtype (see ``_raw.py``).

Direction is part of the kernel name: ``npu_moe_token_unpermute`` is the forward kernel,
``npu_moe_token_unpermute_grad`` the backward kernel, each with its own entry.

A kernel (or an argument) missing from a profile is unrestricted: it reads every dtype
correctly. Arguments that only donate a shape (``tokens`` of ``npu_moe_token_permute_grad``)
are never listed.

Sources are the facts gathered in ``shared/reference/npu-op-facts.md``:
torch_npu 2.13.0 / 2.14.0 wheels (``torch_npu/_op_plugin_docs.py``), torch_npu 2.7.1 docs,
CANN 8.0.RC3 aclnn docs, and MindSpeed's op docs and C++ checks (master).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "DTYPE_NAMES",
    "PROFILES",
    "Profile",
    "ProfileSpec",
    "STACKS",
    "Stack",
    "activate",
    "active",
    "deactivate",
    "resolve",
]

#: Short dtype names used in the profile tables.
DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp32": torch.float32,
        "fp64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }
)

#: A profile as plain data: kernel name -> argument name -> supported dtypes (first = assumed).
ProfileSpec = Mapping[str, Mapping[str, Sequence["str | torch.dtype"]]]

# Ordered so that the assumed dtype (the first) of a float argument is bf16, the dtype the
# Ascend MoE kernels were first written for.
FLOATS = ("bf16", "fp16", "fp32")
BF16 = ("bf16",)
INT32 = ("int32",)

# Kernels whose documented dtypes agree across every source: the same in all profiles.
_COMMON: dict[str, dict[str, tuple[str, ...]]] = {
    # torch_npu 2.13/2.14 _op_plugin_docs.py: tokens fp16/bf16/fp32; routing_map int8 or bool.
    # (The tokens/probs coupling the doc states is not modelled: per argument only.)
    "npu_moe_token_permute_with_routing_map": {
        "tokens": FLOATS,
        "routing_map": ("int8", "bool"),
        "probs": FLOATS,
    },
    # torch_npu 2.13/2.14 _op_plugin_docs.py: sorted_indices int32, probs like permuted_tokens
    # (fp32 allowed with bf16 tokens).
    "npu_moe_token_unpermute_with_routing_map": {
        "permuted_tokens": FLOATS,
        "sorted_indices": INT32,
        "probs": FLOATS,
        "routing_map": ("int8", "bool"),
    },
    # torch_npu 2.13/2.14 docs (aclnnMoeInitRoutingV2): x fp16/bf16/fp32, indices int32.
    "npu_moe_init_routing": {"x": FLOATS, "row_idx": INT32, "expert_idx": INT32},
    # torch_npu 2.13/2.14 docs: all float inputs in expanded_permuted_rows' dtype, indices int32.
    "npu_moe_finalize_routing": {
        "expanded_permuted_rows": FLOATS,
        "skip1": FLOATS,
        "skip2": FLOATS,
        "bias": FLOATS,
        "scales": FLOATS,
        "expanded_src_to_dst_row": INT32,
        "export_for_source_row": INT32,
    },
    # torch_npu 2.13/2.14 docs: x fp16/bf16/fp32, finished bool.
    "npu_moe_gating_top_k_softmax": {"x": FLOATS, "finished": ("bool",)},
    # torch_npu 2.13/2.14 docs: input 1-D int32.
    "npu_moe_compute_expert_tokens": {"sorted_expert_for_source_row": INT32},
    # torch_npu 2.14.0 docs (aclnnGroupedMatmulV4): x fp16/bf16/fp32, int8 when quantized;
    # weight also int8 / int4 (carried in int32) when quantized or antiquant; bias fp16/fp32
    # (fp32 with bf16 x), int32 when quantized; scale fp32/bf16/int64; per_token_scale fp32;
    # antiquant scale/offset fp16/bf16; group_list int64.
    "npu_grouped_matmul": {
        "x": (*FLOATS, "int8"),
        "weight": (*FLOATS, "int8", "int32"),
        "bias": ("fp32", "fp16", "int32"),
        "scale": ("fp32", "bf16", "int64"),
        "per_token_scale": ("fp32",),
        "antiquant_scale": ("bf16", "fp16"),
        "antiquant_offset": ("bf16", "fp16"),
        "group_list": ("int64",),
    },
    # torch_npu 2.13/2.14 docs: self and gamma fp16/bf16/fp32.
    "npu_rms_norm": {"self": FLOATS, "gamma": FLOATS},
    # torch_npu 2.13/2.14 docs: fp16/bf16/fp32.
    "npu_swiglu": {"self": FLOATS},
    # torch_npu 2.13/2.14 docs: all inputs fp16/bf16/fp32.
    "npu_rotary_mul": {"self": FLOATS, "r1": FLOATS, "r2": FLOATS},
}

# The MoE permute/unpermute kernels per torch_npu 2.13/2.14 _op_plugin_docs.py and CANN >= 8.0.0
# aclnn docs: fp16/bf16/fp32 tokens and probs, int32/int64 indices, int32 sorted_indices.
_PERMUTE_WIDE: dict[str, dict[str, tuple[str, ...]]] = {
    "npu_moe_token_permute": {"tokens": FLOATS, "indices": ("int32", "int64")},
    "npu_moe_token_permute_grad": {"grad_permuted_tokens": FLOATS, "sorted_indices": INT32},
    "npu_moe_token_unpermute": {
        "permuted_tokens": FLOATS,
        "sorted_indices": INT32,
        "probs": FLOATS,
    },
    "npu_moe_token_unpermute_grad": {
        "permuted_tokens": FLOATS,
        "grad_unpermuted_tokens": FLOATS,
        "sorted_indices": INT32,
        "probs": FLOATS,
    },
}

PROFILES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    # The narrowest reading of every source (the default).
    "narrow": {
        **_COMMON,
        # MindSpeed docs/ops/npu_moe_token_permute.md, torch_npu 2.7.1 doc, CANN 8.0.RC3:
        # tokens bf16 only; MindSpeed doc: indices int64.
        "npu_moe_token_permute": {"tokens": BF16, "indices": ("int64",)},
        # Same sources: the backward kernel takes bf16 gradients.
        "npu_moe_token_permute_grad": {"grad_permuted_tokens": BF16, "sorted_indices": INT32},
        # MindSpeed docs/ops/npu_moe_token_unpermute.md and its C++ checks (master),
        # torch_npu 2.7.1 doc, CANN 8.0.RC3: permuted_tokens and probs bf16 only.
        "npu_moe_token_unpermute": {
            "permuted_tokens": BF16,
            "sorted_indices": INT32,
            "probs": BF16,
        },
        # Same sources: bf16 only for tokens, probs and the gradients.
        "npu_moe_token_unpermute_grad": {
            "permuted_tokens": BF16,
            "grad_unpermuted_tokens": BF16,
            "sorted_indices": INT32,
            "probs": BF16,
        },
    },
    # The seed incident (first-step NaN): the forward kernels accept fp16/bf16/fp32 as the
    # torch_npu 2.13 docs say, so the forward pass agrees with a GPU reference; the
    # unpermute backward is bf16-only like MindSpeed's JIT-built backward kernel, so fp32
    # probs are misread there and the gradients turn into garbage.
    "incident": {
        **_COMMON,
        **_PERMUTE_WIDE,
        # MindSpeed docs/ops/npu_moe_token_unpermute.md: bf16 only for tokens, probs and
        # grad_probs (the JIT-built C++ backward).
        "npu_moe_token_unpermute_grad": {
            "permuted_tokens": BF16,
            "grad_unpermuted_tokens": BF16,
            "sorted_indices": INT32,
            "probs": BF16,
        },
    },
    # torch_npu 2.13/2.14 docs: fp16/bf16/fp32 wherever those docs allow it.
    "wide": {**_COMMON, **_PERMUTE_WIDE},
}


@dataclass(frozen=True)
class Stack:
    """The real stack a profile's kernels behave as: what the emulation reports while it is
    installed (``opcontracts env``, ``opcontracts run``'s header), so the contracts judge
    calls on the stack whose kernels run.  ``torch_npu`` is the release whose schemas and
    structure the ops have (``install(version=...)`` overrides it); ``soc`` the chip the npu
    device reports (``install(device="...")`` overrides it); ``cann`` the CANN release whose
    kernel limits the profile's tables are, None where no one release is (a custom profile)."""

    torch_npu: str
    cann: str | None
    soc: str
    why: str = ""


_TORCH_NPU = "2.13.0"  # the emulation's default release (``_install.DEFAULT_TORCH_NPU_VERSION``)
_SOC = "Ascend910B3"  # an Atlas A2 training chip (``_device.DEFAULT_SOC``)

STACKS: dict[str, Stack] = {
    # The MoE token kernels are bf16 only: CANN 8.0.RC3's aclnnMoeTokenPermute / Unpermute and
    # their grads (contracts/torch_npu/moe_token_permute.toml, the cann < 8.0.0 tables).
    "narrow": Stack(_TORCH_NPU, "8.0.RC3", _SOC,
                    "the MoE token permute/unpermute kernels and their grads take bf16 only, "
                    "as CANN 8.0.RC3's do"),
    # The unpermute backward is bf16 only (8.0.RC3's limit, MindSpeed's JIT-built op): reported
    # as 8.0.RC3 so that strict mode rejects what that kernel would misread, although the
    # forward kernels here read fp16/fp32 as CANN >= 8.0.0's do.
    "incident": Stack(_TORCH_NPU, "8.0.RC3", _SOC,
                      "the unpermute backward kernel takes bf16 only, as CANN 8.0.RC3's does "
                      "(the forward kernels are wider: strict mode rejects what the backward "
                      "would misread)"),
    # Every kernel as the torch_npu 2.13/2.14 docs describe it: CANN >= 8.0.0's tables; 9.1.0 is
    # the CANN the compatibility table pairs with the newest listed torch_npu (Ascend/pytorch
    # COMPATIBILITY.en.md: 2.12.0 .. 2.7.1.post8 with CANN 9.1.0).
    "wide": Stack(_TORCH_NPU, "9.1.0", _SOC,
                  "every kernel reads the dtypes the torch_npu 2.13/2.14 docs list, as a "
                  "CANN 9.1.0 stack does"),
}
"""Per named profile, the stack it behaves as."""


def _add_families() -> None:
    """The family modules' ops (``_family.EmulatedOp``): their documented dtypes in every
    profile, with their per-profile overrides."""
    from ._family import all_ops

    for op in all_ops():
        for name, table in PROFILES.items():
            table[op.name] = op.profile(name)


_add_families()


def _add_same_kernels() -> None:
    """The release-only ops (``_release.SAME_KERNEL``) read as the kernel they run does."""
    from ._release import SAME_KERNEL

    for table in PROFILES.values():
        for name, kernel in SAME_KERNEL.items():
            if kernel in table:
                table[name] = dict(table[kernel])


_add_same_kernels()


@dataclass(frozen=True)
class Profile:
    """A resolved profile: dtype names turned into ``torch.dtype``, read-only."""

    name: str
    kernels: Mapping[str, Mapping[str, tuple[torch.dtype, ...]]]
    stack: Stack | None = None
    """the stack a named profile behaves as (``STACKS``); None for a custom mapping"""

    def supported(self, kernel: str, arg: str) -> tuple[torch.dtype, ...] | None:
        """The dtypes ``kernel`` reads ``arg`` correctly in, or None when unrestricted."""
        entry = self.kernels.get(kernel)
        if entry is None:
            return None
        return entry.get(arg)

    def as_spec(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """The profile back as plain data with short dtype names."""
        names = {v: k for k, v in DTYPE_NAMES.items()}
        return {
            kernel: {arg: tuple(names.get(d, str(d)) for d in dts) for arg, dts in args.items()}
            for kernel, args in self.kernels.items()
        }


def _to_dtype(value: str | torch.dtype, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.removeprefix("torch.")
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                   "float": "fp32", "float64": "fp64", "double": "fp64"}
        key = aliases.get(key, key)
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ValueError(f"{where}: unknown dtype {value!r}; use one of {sorted(DTYPE_NAMES)}")


def resolve(
    profile: str | ProfileSpec | Profile,
    known: Mapping[str, frozenset[str]] | None = None,
) -> Profile:
    """Turn a profile name or mapping into a :class:`Profile`, validating it.

    ``known`` maps each kernel to its tensor argument names; when given, names outside it are
    rejected, so a typo cannot silently leave a kernel unrestricted.
    """
    if isinstance(profile, Profile):
        return profile
    spec: ProfileSpec
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
        name, spec = profile, PROFILES[profile]
    elif isinstance(profile, Mapping):
        name, spec = "custom", profile
    else:
        raise TypeError(f"profile must be a name or a mapping, not {type(profile).__name__}")

    kernels: dict[str, Mapping[str, tuple[torch.dtype, ...]]] = {}
    for kernel, args in spec.items():
        if known is not None and kernel not in known:
            raise ValueError(f"profile {name!r}: unknown kernel {kernel!r}")
        if not isinstance(args, Mapping):
            raise TypeError(f"profile {name!r}: {kernel} must map argument names to dtypes")
        entry: dict[str, tuple[torch.dtype, ...]] = {}
        for arg, dtypes in args.items():
            where = f"profile {name!r}: {kernel}.{arg}"
            if known is not None and arg not in known[kernel]:
                raise ValueError(f"{where}: {kernel} has no tensor argument {arg!r}")
            listed = [dtypes] if isinstance(dtypes, (str, torch.dtype)) else list(dtypes)
            resolved = tuple(_to_dtype(d, where) for d in listed)
            if not resolved:
                raise ValueError(f"{where}: needs at least one dtype")
            entry[arg] = resolved
        kernels[kernel] = MappingProxyType(entry)
    return Profile(name=name, kernels=MappingProxyType(kernels), stack=STACKS.get(name))


_lock = threading.Lock()
_active: Profile | None = None


def active() -> Profile | None:
    """The profile the emulated kernels read with now (None when not installed)."""
    return _active


def activate(profile: Profile) -> None:
    global _active
    with _lock:
        _active = profile


def deactivate() -> None:
    global _active
    with _lock:
        _active = None
