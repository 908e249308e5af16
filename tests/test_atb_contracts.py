"""The shipped contracts of ATB's attention ops (contracts/atb/attention.toml), judged by op name.

Each op has a table per chip: Atlas A2 / A3 (fp16 or bf16, ND paged caches) and, for the ops
the 310P runs, the 310P (fp16 only, NZ caches whose torch shape varies by caller).  A right call
passes on its chip; a wrong dtype, shape or head count raises a violation naming the argument.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import ContractViolation, patch

A2 = "Ascend910B3"
A3 = "Ascend910_9392"
P310 = "Ascend310P3"
BF16, FP16, I32, I64 = torch.bfloat16, torch.float16, torch.int32, torch.int64


@pytest.fixture
def soc() -> Iterator[Any]:
    def pin(name: str) -> None:
        opcontracts.set_versions(soc=name)

    with opcontracts.versions(soc=A2):  # puts back the pins as they were, whatever pin() set
        yield pin


def t(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def paged(dtype: torch.dtype = BF16, **over: Any) -> dict[str, Any]:
    """A decode step: 4 sequences of one token, 8 query heads over 2 KV heads of 16, 5 blocks
    of 16 slots (dlinfer's decode_attention under graph capture)."""
    kw = dict(query=t(dtype, 4, 8, 16), key_cache=t(dtype, 5, 16, 2, 16),
              value_cache=t(dtype, 5, 16, 2, 16), num_kv_heads=2, num_heads=8,
              scale_value=0.25, block_table=t(I32, 4, 3), context_lens=t(I32, 4),
              out=t(dtype, 4, 8, 16))
    return {**kw, **over}


def mla(**over: Any) -> dict[str, Any]:
    """DeepSeek's MLA decode, scaled down: latent 32 + rope 4 = 36 key channels, value 32."""
    kw = dict(query=t(BF16, 4, 8, 36), key_cache=t(BF16, 5, 16, 1, 36), num_kv_heads=1,
              num_heads=8, scale_value=0.1, block_table=t(I32, 4, 3), context_lens=t(I32, 4),
              mla_vheadsize=32, out=t(BF16, 4, 8, 32))
    return {**kw, **over}


def flash(dtype: torch.dtype = BF16, unpad: bool = False, **over: Any) -> dict[str, Any]:
    """Prefill of two packed sequences (6 tokens), 8 query heads over 2 KV heads of 16."""
    kw: dict[str, Any] = dict(query=t(dtype, 6, 8, 16), key=t(dtype, 6, 2, 16),
                              value=t(dtype, 6, 2, 16), mask=t(dtype, 6, 6),
                              seq_len=torch.tensor([4, 2], dtype=I32), scale_value=0.25,
                              num_heads=8, num_kv_heads=2, out=t(dtype, 6, 8, 16))
    if unpad:
        del kw["mask"]
    return {**kw, **over}


def rejects(op: str, kwargs: dict[str, Any], arg: str, match: str = "") -> None:
    with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
        opcontracts.check(op, **kwargs)
    assert info.value.arg == arg, str(info.value)
    assert f"argument '{arg}'" in str(info.value)
    if match:
        assert match in str(info.value), str(info.value)


def passes(op: str, kwargs: dict[str, Any]) -> None:
    with opcontracts.mode("strict"), warnings.catch_warnings():
        warnings.simplefilter("error")
        opcontracts.check(op, **kwargs)


# --------------------------------------------------------------------------- paged attention
PA = "atb._npu_paged_attention"


@pytest.mark.parametrize("chip", [A2, A3])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_paged_attention_passes_a_decode_step(soc: Any, chip: str, dtype: torch.dtype) -> None:
    soc(chip)
    passes(PA, paged(dtype))
    passes(PA, paged(dtype, num_kv_heads=0))  # the operator's "as many as num_heads"
    passes(PA, paged(dtype, workspace=t(torch.uint8, 64)))  # _npu_paged_attention_get_workspace's
    # lmdeploy's graph buffers: block_table and context_lens sized by max_batches, not the tokens
    passes(PA, paged(dtype, block_table=t(I32, 8, 3), context_lens=t(I32, 8)))


def test_paged_attention_rejects_what_the_operator_does_not_take(soc: Any) -> None:
    rejects(PA, paged(block_table=t(I64, 4, 3)), "block_table", "int32")
    rejects(PA, paged(context_lens=t(I64, 4)), "context_lens", "int32")
    rejects(PA, paged(query=t(torch.float32, 4, 8, 16)), "query")
    rejects(PA, paged(key_cache=t(torch.int8, 5, 16, 2, 16)), "key_cache")  # no quantised mode
    rejects(PA, paged(value_cache=t(FP16, 5, 16, 2, 16)), "value_cache", "dtype of query")
    rejects(PA, paged(key_cache=t(BF16, 5, 12, 2, 16), value_cache=t(BF16, 5, 12, 2, 16)),
            "key_cache")  # block_size a multiple of 16
    rejects(PA, paged(key_cache=t(BF16, 5, 16, 32)), "key_cache")  # (blocks, bs, KVN*D): 3-D
    rejects(PA, paged(num_heads=4), "num_heads")
    rejects(PA, paged(num_kv_heads=8), "num_kv_heads")
    rejects(PA, paged(context_lens=t(I32, 3)), "context_lens")
    # 3 KV heads cannot share 8 query heads (GQA needs N % KVN == 0)
    rejects(PA, paged(key_cache=t(BF16, 5, 16, 3, 16), value_cache=t(BF16, 5, 16, 3, 16),
                      num_kv_heads=3), "out", "N//KVN*KVN")


def test_paged_attention_on_the_310p_takes_fp16_and_nz_caches(soc: Any) -> None:
    soc(P310)
    # vllm-ascend's 310P cache: (blocks, KVN * D / 16, block_size, 16)
    nz = dict(key_cache=t(FP16, 5, 2, 16, 16), value_cache=t(FP16, 5, 2, 16, 16))
    passes(PA, paged(FP16, **nz))
    passes(PA, paged(FP16))  # lmdeploy's: an NZ-format tensor of the ND torch shape
    rejects(PA, paged(BF16), "query")
    rejects(PA, paged(FP16, block_table=t(I64, 4, 3)), "block_table")


def test_paged_attention_on_an_undeclared_chip_warns_for_the_310p_only(soc: Any) -> None:
    """No SoC declared: bf16 is right on the A2 and wrong on the 310P, so the call warns (a
    conditional verdict) and is not raised; an int64 block table is wrong on every chip."""
    soc("unknown")
    with opcontracts.mode("strict"), pytest.warns(opcontracts.ContractConditionalWarning):
        opcontracts.check(PA, **paged(BF16))
    rejects(PA, paged(FP16, block_table=t(I64, 4, 3)), "block_table")


# --------------------------------------------------------------------------- paged attention, MLA
MLA = "atb._npu_paged_attention_mla"


def test_paged_attention_mla(soc: Any) -> None:
    passes(MLA, mla())
    passes(MLA, mla(query=t(FP16, 4, 8, 36), key_cache=t(FP16, 5, 16, 1, 36),
                    out=t(FP16, 4, 8, 32)))
    rejects(MLA, mla(mla_vheadsize=36), "mla_vheadsize")  # out's Dv is 32
    rejects(MLA, mla(block_table=t(I64, 4, 3)), "block_table")
    rejects(MLA, mla(key_cache=t(FP16, 5, 16, 1, 36)), "key_cache", "dtype of query")
    rejects(MLA, mla(num_heads=16), "num_heads")
    rejects(MLA, mla(out=t(BF16, 4, 4, 32)), "out")


# --------------------------------------------------------------------------- flash attention
FA = "atb._npu_flash_attention"
FAU = "atb._npu_flash_attention_unpad"


@pytest.mark.parametrize("op", [FA, FAU])
def test_flash_attention_passes_a_prefill(soc: Any, op: str) -> None:
    unpad = op == FAU
    for dtype in (BF16, FP16):
        passes(op, flash(dtype, unpad))
        passes(op, flash(dtype, unpad, num_kv_heads=0))
        # the operator's other seq_len form: query lengths over KV lengths
        passes(op, flash(dtype, unpad, seq_len=torch.tensor([[4, 2], [4, 2]], dtype=I32)))
        # 2-D inputs (T, heads * head_size), A2 / A3
        passes(op, flash(dtype, unpad, query=t(dtype, 6, 128), key=t(dtype, 6, 32),
                         value=t(dtype, 6, 32), out=t(dtype, 6, 128)))
    soc(P310)
    passes(op, flash(FP16, unpad))


@pytest.mark.parametrize("op", [FA, FAU])
def test_flash_attention_rejects(soc: Any, op: str) -> None:
    unpad = op == FAU
    rejects(op, flash(unpad=unpad, seq_len=torch.tensor([4, 2])), "seq_len", "int32")
    rejects(op, flash(unpad=unpad, key=t(FP16, 6, 2, 16)), "key", "dtype of query")
    rejects(op, flash(unpad=unpad, value=t(BF16, 5, 2, 16)), "value")
    rejects(op, flash(unpad=unpad, num_heads=2), "num_heads")
    rejects(op, flash(unpad=unpad, num_kv_heads=8), "num_kv_heads")
    rejects(op, flash(unpad=unpad, key=t(BF16, 6, 3, 16), value=t(BF16, 6, 3, 16),
                      num_kv_heads=3), "out", "N//KVN*KVN")
    soc(P310)
    rejects(op, flash(BF16, unpad), "query")


def test_flash_attention_mask(soc: Any) -> None:
    for mask in (t(BF16, 2, 6, 6), t(BF16, 2, 1, 6), t(BF16, 2, 8, 6, 6)):
        passes(FA, flash(mask=mask))
    rejects(FA, flash(mask=t(torch.bool, 6, 6)), "mask")
    rejects(FA, flash(mask=t(BF16, 6)), "mask")


# --------------------------------------------------------------------------- through the patch
_SCHEMA = ("_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
           "int num_kv_heads, int num_heads, float scale_value, Tensor block_table, "
           "Tensor context_lens, Tensor(a!) out, *, Tensor? workspace=None) -> ()")


@pytest.fixture
def atb_plugin(atb_plugin_loaded: Any) -> Iterator[list[Any]]:
    """What loading torch_npu's ATB plugin does (torch.ops.load_library): define the op with
    op-plugin's schema in the ``atb`` namespace; its kernel records the calls it gets."""
    calls: list[Any] = []
    with atb_plugin_loaded(_SCHEMA, lambda *a, **k: calls.append(a)):
        yield calls


def test_the_patch_guards_the_atb_op_and_torch_npus_name_for_it(soc: Any,
                                                               atb_plugin: list[Any]) -> None:
    """The shipped contract reaches the op the plugin loads after the patch, also through
    torch_npu's lazy name for it (op_plugin/atb/_atb_ops.py: getattr(torch.ops.atb, name))."""
    patch.apply()
    torch.ops.load_library("libop_plugin_atb.so")

    name = "_npu_paged_attention"

    def torch_npu_name(*args: Any, **kwargs: Any) -> Any:  # torch_npu._npu_paged_attention
        return getattr(torch.ops.atb, name)(*args, **kwargs)

    with opcontracts.mode("strict"):
        torch_npu_name(**paged())
        assert len(atb_plugin) == 1
        with pytest.raises(ContractViolation, match="block_table"):
            torch_npu_name(**paged(block_table=t(I64, 4, 3)))
    assert len(atb_plugin) == 1  # the wrong call never reached the kernel
