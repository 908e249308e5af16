"""The torch_npu surface real code imports, on the emulation: ``torch_npu.testing`` as torch_npu's
op tests use it, ``transfer_to_npu``, the device module's random state, streams, events, graphs,
memory statistics and CANN version, ``torchair``, the dtypes, and the one line an import the
emulation does not have gets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import opcontracts
from opcontracts import emulation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def npu(npu_device: Any) -> Any:
    """conftest's ``npu_device``: the emulation with its device, no patch."""
    return npu_device


def _case() -> Any:
    from torch_npu.testing.testcase import TestCase

    class Probe(TestCase):
        def runTest(self) -> None:  # noqa: N802
            pass

    return Probe()


def _run(cls: type) -> unittest.TestResult:
    with open(os.devnull, "w") as quiet:
        return unittest.TextTestRunner(stream=quiet).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(cls))


def _fails(check: Any) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


# -- torch_npu.testing ---------------------------------------------------------------------------

def test_assert_rtol_equal_takes_the_tolerance_of_the_dtype(npu: Any) -> None:
    case = _case()
    x = np.ones(100, dtype=np.float32)
    # a relative error of 5e-4: within fp16's 1e-3, outside fp32's 1e-4
    case.assertRtolEqual(x.astype(np.float16), (x * (1 + 5e-4)).astype(np.float16))
    assert _fails(lambda: case.assertRtolEqual(x, x * (1 + 5e-4)))
    case.assertRtolEqual(x, x * (1 + 5e-5))
    case.assertRtolEqual(x, x * (1 + 5e-4), prec=1e-3)  # the test's own precision
    # bf16 pairs: allclose with rtol = atol = prec16
    a = torch.ones(8, dtype=torch.bfloat16)
    case.assertRtolEqual(a, a + 0.0009765625 / 2)
    assert _fails(lambda: case.assertRtolEqual(a, a + 0.0625))


def test_assert_rtol_equal_tolerates_a_few_outliers_as_the_real_one(npu: Any) -> None:
    case = _case()
    x = np.ones(100_000, dtype=np.float32)
    few, many = x.copy(), x.copy()
    few[:5] = 2.0      # 5 misses <= size * prec (10): passes
    many[:20] = 2.0    # 20 misses: fails
    case.assertRtolEqual(x, few)
    assert _fails(lambda: case.assertRtolEqual(x, many))


def test_assert_rtol_equal_checks_nans_shapes_dtypes_and_bools(npu: Any) -> None:
    case = _case()
    x = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    case.assertRtolEqual(x, x.copy())
    assert _fails(lambda: case.assertRtolEqual(x, np.array([1.0, 2.0, np.nan], dtype=np.float32)))
    assert _fails(lambda: case.assertRtolEqual(np.ones(3, np.float32), np.ones(4, np.float32)))
    assert _fails(lambda: case.assertRtolEqual(np.ones(3, np.float32), np.ones(3, np.float64)))
    assert _fails(lambda: case.assertRtolEqual(np.array([True, False]), np.array([True, True])))
    # npu tensors and lists of them are compared on the CPU
    t = torch.randn(4, 4)
    case.assertRtolEqual([t, t], [t.npu(), t.npu()])


def test_assert_equal_compares_tensors_across_devices_by_their_largest_difference(npu: Any) -> None:
    case = _case()
    t = torch.randn(3, 5)
    case.assertEqual(t.npu(), t + 5e-6)            # within the class precision, 1e-5
    assert _fails(lambda: case.assertEqual(t.npu(), t + 1e-3))
    case.assertEqual(t.npu(), t + 1e-3, prec=1e-2)
    case.assertEqual((t, 2.0), (t.clone(), 2.0))
    assert _fails(lambda: case.assertEqual(t, t[:2]))


def test_the_testcase_selects_the_device_and_seeds_from_seed(npu: Any, monkeypatch: Any) -> None:
    from torch_npu.testing.testcase import TestCase

    seen: list[torch.Tensor] = []

    class T(TestCase):
        def test_draw(self) -> None:
            self.assertEqual(self.npu_device, "npu:0")
            seen.append(torch.rand(3))

    monkeypatch.setenv("SEED", "1234")
    for _ in range(2):
        result = _run(T)
        assert result.wasSuccessful(), result.errors + result.failures
    torch.manual_seed(1234)
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[0], torch.rand(3))


def test_the_skip_decorators_read_the_soc_the_device_count_and_the_cann(npu: Any) -> None:
    from torch_npu.testing.common_distributed import skipIfUnsupportMultiNPU
    from torch_npu.testing.common_utils import SkipIfNotGteCANNVersion, SupportedDevices
    from torch_npu.testing.testcase import TestCase

    ran: list[str] = []

    class T(TestCase):
        @SupportedDevices(["Ascend910B"])
        def test_910b(self) -> None:
            ran.append("910b")

        @SupportedDevices(["Ascend950"])
        def test_950(self) -> None:
            ran.append("950")

        @skipIfUnsupportMultiNPU(8)
        def test_eight(self) -> None:
            ran.append("eight")

        @SkipIfNotGteCANNVersion("9.0.0")
        def test_cann9(self) -> None:
            ran.append("cann9")

    result = _run(T)
    assert ran == ["910b"] and len(result.skipped) == 3
    reasons = " | ".join(r for _, r in result.skipped)
    assert "current device is Ascend910B" in reasons and "Multi-NPU 8" in reasons
    assert "current cann version is 8.0.RC3" in reasons
    opcontracts.set_versions(cann="9.0.0")
    ran.clear()
    _run(T)
    assert sorted(ran) == ["910b", "cann9"]


def test_create_common_tensor_gives_the_same_data_on_cpu_and_npu(npu: Any) -> None:
    from torch_npu.testing.common_utils import create_common_tensor, create_dtype_tensor

    cpu, dev = create_common_tensor([np.float16, 2, (3, 4)], -1, 1)
    assert cpu.device.type == "cpu" and dev.device.type == "npu"
    assert cpu.dtype == dev.dtype == torch.float16 and torch.equal(cpu, dev.cpu())
    assert cpu.abs().max() <= 1
    cpu, dev = create_dtype_tensor((5,), torch.int32, no_zero=True)
    assert torch.equal(cpu, dev.cpu()) and bool((cpu != 0).all())


def test_instantiate_tests_makes_one_test_per_dtype(npu: Any) -> None:
    from torch_npu.testing.decorator import Dtypes, instantiate_tests
    from torch_npu.testing.testcase import TestCase

    @instantiate_tests
    class T(TestCase):
        @Dtypes(torch.float16, torch.float32)
        def test_op(self, device: str, dtype: torch.dtype) -> None:
            assert device == "npu" and dtype in (torch.float16, torch.float32)

    names = sorted(n for n in vars(T) if n.startswith("test_"))
    assert names == ["test_op_float16", "test_op_float32"]
    result = _run(T)
    assert result.wasSuccessful() and result.testsRun == 2


# -- torch.npu / torch_npu.npu ---------------------------------------------------------------------

def test_the_rng_state_round_trips_and_fork_rng_restores_it(npu: Any) -> None:
    state = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    first = torch.randn(4, device="npu").cpu()
    torch.npu.set_rng_state(state)  # type: ignore[attr-defined]
    assert torch.equal(torch.randn(4, device="npu").cpu(), first)
    torch.npu.manual_seed(7)  # type: ignore[attr-defined]
    before = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    with torch.random.fork_rng(device_type="npu"):
        torch.randn(8, device="npu")
    assert torch.equal(torch.npu.get_rng_state(), before)  # type: ignore[attr-defined]
    assert torch.npu.initial_seed() == 7  # type: ignore[attr-defined]


def test_streams_and_events_work_as_in_real_scripts(npu: Any) -> None:
    side = torch.npu.Stream()  # type: ignore[attr-defined]
    main = torch.npu.current_stream()  # type: ignore[attr-defined]
    with torch.npu.stream(side):  # type: ignore[attr-defined]
        assert torch.npu.current_stream() is side  # type: ignore[attr-defined]
        side.wait_stream(main)
        y = torch.ones(4, device="npu") * 2
    assert torch.npu.current_stream() is main and side.query()  # type: ignore[attr-defined]
    start = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
    end = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
    start.record()
    y.sum().item()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    untimed = torch.npu.Event()  # type: ignore[attr-defined]
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        untimed.elapsed_time(end)


def test_an_npu_graph_replays_into_the_captured_outputs(npu: Any) -> None:
    static_in = torch.ones(3, device="npu")
    graph = npu.npu.NPUGraph()
    with npu.npu.graph(graph):
        out = static_in * 2 + 1
        noise = torch.rand(3, device="npu")
    assert out.cpu().tolist() == [3.0, 3.0, 3.0]
    static_in.fill_(5)
    state = torch.npu.get_rng_state()  # type: ignore[attr-defined]
    graph.replay()
    assert out.cpu().tolist() == [11.0, 11.0, 11.0]
    torch.npu.set_rng_state(state)  # type: ignore[attr-defined]
    assert torch.equal(noise.cpu(), torch.rand(3))  # replay drew again from the generator


def test_config_compile_mode_memory_and_cann(npu: Any) -> None:
    torch.npu.config.allow_internal_format = False  # type: ignore[attr-defined]
    torch.npu.set_compile_mode(jit_compile=False)  # type: ignore[attr-defined]
    assert torch.npu.is_jit_compile_false()  # type: ignore[attr-defined]
    assert torch.npu.memory_allocated() == 0 == torch.npu.max_memory_reserved()  # type: ignore[attr-defined]
    torch.npu.reset_peak_memory_stats()  # type: ignore[attr-defined]
    free, total = torch.npu.mem_get_info()  # type: ignore[attr-defined]
    assert 0 < free <= total
    assert torch.npu.get_device_properties(0).name == "Ascend910B3"  # type: ignore[attr-defined]
    import torch_npu.npu.utils as npu_utils

    assert npu_utils.get_cann_version() == npu.utils.get_cann_version() == "8.0.RC3"
    assert not npu_utils._is_gte_cann_version("8.0.0")
    opcontracts.set_versions(cann="8.1.RC1")
    assert npu.utils.get_cann_version() == "8.1.RC1" and npu_utils._is_gte_cann_version("8.0.0")


def test_the_extra_dtypes_are_torch_npu_dtype_numbers(npu: Any) -> None:
    assert (npu.hifloat8, npu.float8_e8m0fnu, npu.float4_e2m1fn_x2, npu.int4) == (290, 293, 296, 285)
    assert npu.float32 == 256 and npu.bfloat16 == 283


def test_torchair_compiles_through_its_npu_backend(npu: Any) -> None:
    import torchair
    from torchair.configs.compiler_config import CompilerConfig

    config = CompilerConfig()
    config.experimental_config.frozen_parameter = True
    with pytest.raises(ValueError, match="has no option modee"):
        config.modee = "reduce-overhead"
    fn = torch.compile(lambda t: torch.relu(t) * 3,
                       backend=torchair.get_npu_backend(compiler_config=config))
    x = torch.tensor([-1.0, 2.0], device="npu")
    out = fn(x)
    assert out.device.type == "npu" and out.cpu().tolist() == [0.0, 6.0]


# -- transfer_to_npu ---------------------------------------------------------------------------------

def test_transfer_to_npu_routes_cuda_to_npu_until_uninstall() -> None:
    originals = (torch.cuda.is_available, torch.zeros, torch.Tensor.to, torch.nn.Module.to,
                 torch.jit.script)
    emulation.install("narrow", device=True)
    try:
        with pytest.warns(Warning):
            from torch_npu.contrib import transfer_to_npu  # noqa: F401
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.zeros(2, device="cuda").device.type == "npu"
        assert torch.ones(2).to("cuda:0").device == torch.device("npu", 0)
        assert torch.ones(2).cuda().is_npu and torch.ones(2).npu().is_cuda
        model = torch.nn.Linear(2, 2).cuda()
        assert model.weight.device.type == "npu"
        assert torch.nn.Linear(2, 2).to(torch.device("cuda")).weight.device.type == "npu"
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        a = torch.randn(3, device="cuda").cpu()
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.randn(3, device="cuda").cpu())
        assert torch.cuda.CUDAGraph is torch.npu.NPUGraph  # type: ignore[attr-defined]
    finally:
        emulation.uninstall()
    assert (torch.cuda.is_available, torch.zeros, torch.Tensor.to, torch.nn.Module.to,
            torch.jit.script) == originals
    assert not torch.cuda.is_available() and "cuda" not in vars(torch.Tensor)


def test_megatron_adaptor_imports_transfer_to_npu_first(npu: Any) -> None:
    import mindspeed.megatron_adaptor  # noqa: F401

    assert torch.zeros(1, device="cuda").is_npu


# -- what is not emulated ----------------------------------------------------------------------------

def test_an_import_the_emulation_lacks_names_it(npu: Any) -> None:
    from opcontracts.emulation._surface import NotEmulatedError

    with pytest.raises(ModuleNotFoundError, match="does not emulate torch_npu.some") as info:
        import torch_npu.some.unknown.module  # type: ignore[import-not-found]  # noqa: F401
    assert isinstance(info.value, NotEmulatedError) and info.value.name == "torch_npu.some"
    with pytest.raises(AttributeError, match="does not emulate torch_npu.dynamo"):
        npu.dynamo  # noqa: B018
    assert not hasattr(npu, "dynamo")


def test_run_prints_one_line_for_an_import_the_emulation_lacks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        import torch_npu
        import torch_npu.some.unknown.module
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "opcontracts", "run", "--emulate", "-q", str(script)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{script}:3: import torch_npu.some.unknown.module" in lines[0]
    assert "does not emulate torch_npu.some" in lines[0] and "emulated-device.md" in lines[0]


def test_a_cuda_script_runs_with_transfer_to_npu_in_a_fresh_process(tmp_path: Path) -> None:
    script = tmp_path / "cuda_train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        import torch_npu
        from torch_npu.contrib import transfer_to_npu
        model = torch.nn.Linear(4, 2).cuda()
        x = torch.randn(3, 4, device="cuda")
        model(x).sum().backward()
        torch.cuda.synchronize()
        print(x.device, model.weight.grad.device)
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "opcontracts", "run", "--emulate", "-q", str(script)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "npu:0 npu:0"


def test_default_generators_state_is_get_rng_states(npu: Any) -> None:
    # Megatron's _set_cuda_rng_state sets torch.cuda.get_rng_state()'s through
    # default_generators[idx].set_state: one state, whichever way it is taken
    gen = torch.npu.default_generators[torch.npu.current_device()]
    state = torch.npu.get_rng_state()
    assert torch.equal(gen.get_state(), state)
    a = torch.randn(4, device="npu")
    gen.set_state(state)
    assert torch.equal(torch.randn(4, device="npu").cpu(), a.cpu())
    assert len(torch.npu.default_generators) == torch.npu.device_count()


# -- a real MindSpeed on the path, and what its adaptor and ops import ---------------------------

_REAL_MINDSPEED = {
    "mindspeed/__init__.py": "REAL = True\n",
    # as MindSpeed's op_builder/builder.py: load imported by name, its own mindspeed library,
    # the CANN root from ASCEND_HOME_PATH
    "mindspeed/op_builder.py": textwrap.dedent("""
        import os
        from torch.utils.cpp_extension import load
        from torch.library import Library
        AS_LIBRARY = Library("mindspeed", "DEF")
        AS_LIBRARY.define("probe(Tensor x) -> Tensor")
        CANN = os.environ["ASCEND_HOME_PATH"]
        assert os.path.exists(CANN) and os.path.exists(os.environ["ATB_HOME_PATH"])

        def build(name):
            return load(name=name, sources=[os.path.join(CANN, "x.cpp")],
                        extra_include_paths=[os.path.join(CANN, "include")], verbose=False)
        """),
    "mindspeed/ops/__init__.py": "",
    "acl.py": "REAL = True\n",
}


def test_a_real_mindspeed_on_the_path_is_imported_and_its_jit_builds_load(tmp_path: Path) -> None:
    for name, text in _REAL_MINDSPEED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    script = textwrap.dedent(f"""
        import os, sys
        os.environ.pop("ASCEND_HOME_PATH", None)
        os.environ.pop("ATB_HOME_PATH", None)
        from opcontracts import emulation
        emulation.install("narrow", device=True)
        sys.path.insert(0, {str(tmp_path)!r})
        import torch, mindspeed, acl
        import mindspeed.ops
        from mindspeed import op_builder
        assert mindspeed.REAL and acl.REAL and not hasattr(mindspeed, "__opcontracts_emulation__")
        ring = op_builder.build("npu_ring_attention_update")
        S, B, N, D = 3, 1, 2, 4
        out = [torch.randn(S, B, N * D, device="npu")]
        stats = [torch.rand(B, N, S, 8, device="npu") + 0.5 for _ in range(2)]
        res = ring.npu_ring_attention_update(out[0], stats[0], stats[1], out[0], stats[0], stats[1], None, "SBH")
        assert isinstance(res, list) and len(res) == 3 and res[0].device.type == "npu"
        assert torch.allclose(res[0].cpu(), out[0].cpu(), atol=1e-5)  # the same result twice: itself
        try:
            op_builder.build("no_such_extension")
        except Exception as exc:
            print("compiled", type(exc).__name__)
        emulation.uninstall()
        import torch.utils.cpp_extension as cpp
        assert cpp.load.__module__ == "torch.utils.cpp_extension" and "ASCEND_HOME_PATH" not in os.environ
        assert "ATB_HOME_PATH" not in os.environ
        print("ok")
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[-1] == "ok" and "compiled" in lines  # an unknown extension is compiled, and fails


def test_the_stand_in_mindspeed_defines_its_library_only_when_used(npu: Any) -> None:
    from opcontracts.emulation import _jit

    assert _jit._state["library"] is None   # a real MindSpeed imported now could define its own
    import mindspeed.ops.gmm  # noqa: F401

    assert _jit._state["library"] is not None and hasattr(torch.ops.mindspeed, "npu_gmm")


def test_lazy_call_runs_at_the_devices_first_use(npu: Any) -> None:
    calls: list[str] = []
    assert not torch.npu.is_initialized()
    torch.npu._lazy_call(lambda: calls.append("rng"))
    assert calls == []
    torch.empty(1, device="npu")
    assert calls == ["rng"] and torch.npu.is_initialized()
    torch.npu._lazy_call(lambda: calls.append("now"))
    assert calls == ["rng", "now"]


def test_what_mindspeed_imports_at_start_up(npu: Any) -> None:
    import acl
    import torchair
    from torch_npu.profiler import AiCMetrics, ProfilerActivity, ProfilerLevel
    from torch_npu.profiler.profiler import analyse
    from torch_npu.utils.collect_env import get_cann_version
    from torchair.ge import DataType

    assert acl.get_soc_name() == torch.npu.get_device_name() == "Ascend910B3"
    assert acl.rt.get_device_count() == (1, 0) and acl.rt.set_device(3) == 107001
    free, total, ret = acl.rt.get_mem_info(0)
    assert ret == 0 and 0 < free <= total
    assert get_cann_version() == torch_npu_cann()
    assert ProfilerLevel.Level1 == "Level1" and AiCMetrics.PipeUtilization == "ACL_AICORE_PIPE_UTILIZATION"
    assert {ProfilerActivity.CPU, ProfilerActivity.NPU} == set(ProfilerActivity)
    with pytest.raises(NotImplementedError, match="analyse"):
        analyse("/tmp/prof")
    assert (DataType.DT_FLOAT, DataType.DT_FLOAT16, DataType.DT_BF16, DataType.DT_INT64) == (0, 1, 27, 9)

    def convert(x: Any) -> Any:
        return x

    assert torchair.register_fx_node_ge_converter(torch.ops.aten.add.Tensor)(convert) is convert
    from opcontracts.emulation import _torchair_ge

    assert _torchair_ge.converters()[torch.ops.aten.add.Tensor] is convert


def torch_npu_cann() -> str:
    import torch_npu

    return str(torch_npu.utils.get_cann_version())


def test_hccl_process_group_options_as_mindspeed_builds_them(npu: Any) -> None:
    import torch_npu

    options_type = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options
    assert hasattr(options_type, "hccl_config")  # a field of the class, as pybind binds it
    options = options_type()
    config = options.hccl_config
    config.update({"group_name": "dp", "hccl_buffer_size": 200})
    options.hccl_config = config
    assert options.hccl_config == {"group_name": "dp", "hccl_buffer_size": 200}
    assert options.global_ranks_in_group == [] and not options.is_high_priority_stream
