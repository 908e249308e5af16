"""``torch_npu.testing``: the helpers torch_npu's and op-plugin's op tests import.

The real package (``torch_npu/testing/``) gives its op tests a ``TestCase`` whose comparisons
know the NPU's precisions, ``run_tests``, tensor makers that build the same data on CPU and
on the device, and skip decorators by SoC, CANN version and device count.  The emulation
builds the same names with the same behaviour (written here from what they do, not copied):

* ``testcase.TestCase``: ``setUpClass`` selects ``npu:0`` (``$SET_NPU_DEVICE``), ``setUp``
  seeds torch and ``random`` from ``$SEED`` (666); ``assertRtolEqual(x, y, prec=1e-4,
  prec16=1e-3)``: bf16 pairs by ``allclose(rtol=atol=prec16)``; fp16 with ``prec16``, the
  other dtypes with ``prec``, passing when every element is within the absolute or the
  relative bound, or when at most ``size * prec`` elements miss each; NaNs must sit in the
  same places; shapes and dtypes must agree.  ``assertEqual(x, y, prec=None)``: tensors by
  their largest absolute difference (``prec`` defaults to ``TestCase.precision``, 1e-5),
  numbers, sequences and dicts element by element; ``run_tests()`` is ``unittest.main``;
* ``common_utils``: ``create_common_tensor([np_dtype, npu_format, shape], min, max)`` (CPU and
  npu tensors of the same uniform data), ``create_dtype_tensor``, ``SupportedDevices([...])``
  (skips unless the SoC's family, e.g. ``Ascend910B``, is listed), ``SkipIfNotGteCANNVersion``,
  ``get_npu_device``, ``set_npu_device``, ``freeze_rng_state``, ``iter_indices``,
  ``is_iterable``, ``test_2args_broadcast``, ``check_operators_in_prof``;
* ``common_distributed``: ``skipIfUnsupportMultiNPU(n)`` (the emulated device count is 1),
  ``TEST_SKIPS``;
* ``decorator``: ``Dtypes``, ``Formats``, ``instantiate_tests`` (one test per dtype / format).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import random
import sys
import types
import unittest
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from numbers import Number
from typing import Any

import torch

from ._naming import own

__all__ = ["TABLE"]


def _torch_npu() -> Any:
    return sys.modules["torch_npu"]


# -- common_utils -------------------------------------------------------------------------------

def _common_utils(module: types.ModuleType) -> None:
    import numpy as np

    @contextmanager
    def freeze_rng_state():  # type: ignore[no-untyped-def]
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)

    def iter_indices(tensor):  # type: ignore[no-untyped-def]
        if tensor.dim() == 0:
            return range(0)
        if tensor.dim() == 1:
            return range(tensor.size(0))
        return itertools.product(*(range(s) for s in tensor.size()))

    def is_iterable(obj):  # type: ignore[no-untyped-def]
        try:
            iter(obj)
        except TypeError:
            return False
        return True

    def get_npu_device():  # type: ignore[no-untyped-def]
        index = os.environ.get("SET_NPU_DEVICE")
        return "npu:0" if index is None else f"npu:{index}"

    def set_npu_device():  # type: ignore[no-untyped-def]
        device = get_npu_device()
        torch.npu.set_device(device)  # type: ignore[attr-defined]
        return device

    def _format_cast(npu_input, npu_format):  # type: ignore[no-untyped-def]
        # one storage format on the emulated device (ND): a cast keeps the values
        cast = getattr(_torch_npu(), "npu_format_cast", None)
        return npu_input if cast is None else cast(npu_input, npu_format)

    def create_common_tensor(item, minValue, maxValue, device=None):  # type: ignore[no-untyped-def]  # noqa: N803
        device = get_npu_device() if device is None else device
        dtype, npu_format, shape = item[0], item[1], item[2]
        data = np.random.uniform(minValue, maxValue, shape).astype(dtype)
        cpu_input = torch.from_numpy(data)
        npu_input = torch.from_numpy(data).to(device)
        if npu_format != -1:
            npu_input = _format_cast(npu_input, npu_format)
        return cpu_input, npu_input

    def create_dtype_tensor(shape, dtype, npu_format=-1, min_value=-5, max_value=5, no_zero=False, device=None):  # type: ignore[no-untyped-def]
        device = get_npu_device() if device is None else device
        if dtype == torch.bool:
            data = np.random.randint(0, 2, size=shape).astype(bool)
        elif dtype == torch.half:
            data = np.random.uniform(min_value, max_value, shape).astype(np.float16)
        elif dtype == torch.float:
            data = np.random.uniform(min_value, max_value, shape).astype(np.float32)
        else:
            data = np.random.randint(min_value, max_value + 1, size=shape).astype(np.int32)
        if no_zero:
            data = np.where(data != 0, data, np.ones_like(data))
        cpu_input = torch.from_numpy(data)
        npu_input = torch.from_numpy(data).to(device)
        if npu_format != -1 and dtype in (torch.float, torch.half):
            npu_input = _format_cast(npu_input, npu_format)
        return cpu_input, npu_input

    def test_2args_broadcast(fn):  # type: ignore[no-untyped-def]
        outputs = []
        device = get_npu_device()
        for x_shape, y_shape in (((2, 3, 4, 5), (1, 1, 1)), ((2, 3, 4, 5), (4, 5))):
            x = np.random.rand(*x_shape).astype(np.float32)
            y = np.random.rand(*y_shape).astype(np.float32)
            cpu_out = fn(torch.from_numpy(x), torch.from_numpy(y)).numpy()
            npu_out = fn(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)).to("cpu").numpy()
            outputs.append([cpu_out, npu_out])
        return outputs

    test_2args_broadcast.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test

    def check_operators_in_prof(expected_operators, prof, unexpected_operators=None):  # type: ignore[no-untyped-def]
        unexpected = unexpected_operators or []
        averages = prof.key_averages()
        if not averages:
            print("torch profiling is empty, please check it")
            return None
        for item in averages:
            key = item.key.replace("cached_", "")
            if key in unexpected:
                return False
            if key in expected_operators:
                expected_operators.remove(key)
        return not expected_operators

    class SupportedDevices:
        """Skip unless the SoC's family (``Ascend910B``, ``Ascend910_93``, ``Ascend950``)
        is one of ``supported_devices``."""

        def __init__(self, supported_devices):  # type: ignore[no-untyped-def]
            self.supported_devices = supported_devices

        def __call__(self, fn):  # type: ignore[no-untyped-def]
            @functools.wraps(fn)
            def dep_fn(slf, *args, **kwargs):  # type: ignore[no-untyped-def]
                name = _torch_npu().npu.get_device_name(0)
                family = name[:10]
                if family == "Ascend910_":
                    family = name[:12]
                elif family.startswith("Ascend950"):
                    family = name[:9]
                if family not in self.supported_devices:
                    raise unittest.SkipTest(
                        f"Only run on {self.supported_devices!r}, current device is {family}.")
                return fn(slf, *args, **kwargs)
            return dep_fn

    class SkipIfNotGteCANNVersion:
        """Skip unless the CANN version is ``base_version`` or later."""

        def __init__(self, base_version, module="CANN"):  # type: ignore[no-untyped-def]
            self.base_version = base_version
            self.module = module

        def __call__(self, fn):  # type: ignore[no-untyped-def]
            @functools.wraps(fn)
            def func(slf, *args, **kwargs):  # type: ignore[no-untyped-def]
                tn = _torch_npu()
                current = tn.utils.get_cann_version(module=self.module)
                if not tn.npu.utils._is_gte_cann_version(self.base_version, module=self.module):
                    raise unittest.SkipTest(f"Only run on {self.base_version} or greater, "
                                            f"current cann version is {current}.")
                return fn(slf, *args, **kwargs)
            return func

    own(module, [freeze_rng_state, iter_indices, is_iterable, get_npu_device, set_npu_device,
                 create_common_tensor, create_dtype_tensor, test_2args_broadcast,
                 check_operators_in_prof, SupportedDevices, SkipIfNotGteCANNVersion])
    module.PERF_TEST_ENABLE = False  # type: ignore[attr-defined]


# -- testcase -----------------------------------------------------------------------------------

def _rtol_failed(x: Any, y: Any, prec: float, minimum: float) -> bool:
    """Whether two numpy arrays miss torch_npu's relative/absolute bound (see the module doc)."""
    import numpy as np

    nan = np.isnan(x)
    if not np.equal(nan, np.isnan(y)).all():
        return True
    diff = (y - x).astype(np.float64) if x.dtype != np.bool_ else (y != x).astype(np.float64)
    if nan.any():
        diff[nan] = 0
    err = np.abs(diff)
    within_abs = err <= prec
    scale = np.maximum(np.abs(x), np.abs(y)).astype(np.float64)
    within_rel = err / (scale + minimum) <= prec
    if within_rel.all() or within_abs.all():
        return False
    size = x.size
    return bool(np.sum(~within_rel) > size * prec and np.sum(~within_abs) > size * prec)


def _testcase(module: types.ModuleType) -> None:
    import numpy as np
    from torch_npu.testing.common_utils import iter_indices, set_npu_device  # type: ignore[import-not-found]

    float_like = (np.uint16, np.int16, np.int32, np.float32, np.int8, np.uint8, np.int64, np.float64)

    def run_tests():  # type: ignore[no-untyped-def]
        unittest.main(argv=sys.argv)

    class TestCase(unittest.TestCase):
        """torch_npu's op-test base class (see the module doc for its comparisons)."""

        _precision = 1e-5
        maxDiff = None
        exact_dtype = False

        @property
        def precision(self):  # type: ignore[no-untyped-def]
            return self._precision

        @precision.setter
        def precision(self, prec):  # type: ignore[no-untyped-def]
            self._precision = prec

        @classmethod
        def setUpClass(cls):  # type: ignore[no-untyped-def]
            cls.npu_device = set_npu_device()

        def setUp(self):  # type: ignore[no-untyped-def]
            seed = int(os.getenv("SEED", "666"))
            torch.manual_seed(seed)
            random.seed(seed)

        def assertRtolEqual(self, x, y, prec=1.e-4, prec16=1.e-3, auto_trans_dtype=False, message=None):  # type: ignore[no-untyped-def]  # noqa: N802
            if isinstance(x, Sequence) and isinstance(y, Sequence):
                for a, b in zip(x, y, strict=False):
                    self.assertRtolEqual(a, b, prec, prec16, auto_trans_dtype, message)
                return
            if isinstance(x, torch.Tensor) and isinstance(y, Sequence):
                y = torch.as_tensor(y, dtype=x.dtype, device=x.device)
            elif isinstance(x, Sequence) and isinstance(y, torch.Tensor):
                x = torch.as_tensor(x, dtype=y.dtype, device=y.device)
            if torch.is_tensor(x) and torch.is_tensor(y):
                if auto_trans_dtype:
                    x = x.to(y.dtype)
                if x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16:
                    if x.shape != y.shape:
                        self.fail("shape error!")
                    if not torch.allclose(x.cpu(), y.cpu(), rtol=prec16, atol=prec16):
                        self.fail("result error!")
                    return
                x = x.detach().cpu().numpy()
                y = y.detach().cpu().numpy()
            elif isinstance(x, Number) and isinstance(y, Number):
                x, y = np.array(x), np.array(y)
            if x.shape != y.shape:
                self.fail("shape error")
            if x.dtype != y.dtype:
                self.fail("dtype error")
            if x.dtype == np.bool_:
                if not np.equal(x, y).all():
                    self.fail("result error")
            elif x.dtype == np.float16:
                if _rtol_failed(x, y, prec16, 6e-8):
                    self.fail("result error")
            elif x.dtype in float_like:
                if _rtol_failed(x, y, prec, 1e-9):
                    self.fail("result error")
            else:
                self.fail("required dtype in [np.bool_, np.uint16, np.int16, np.int32, "
                          "np.float16, np.float32, np.int8, np.uint8, np.int64]")

        def assertTensorsSlowEqual(self, x, y, prec=None, message=""):  # type: ignore[no-untyped-def]  # noqa: N802
            self.assertEqual(x.size(), y.size())
            self.assertEqual(x.dtype, y.dtype)
            y = y.type_as(x)
            if x.dtype == torch.bool:
                self.assertEqual(x, y)
                return
            worst = 0
            for index in iter_indices(x):
                worst = max(worst, abs(x[index] - y[index]))
            self.assertLessEqual(worst, prec, message)

        def _tensor_equal(self, a, b, message, exact_dtype, allow_inf, prec):  # type: ignore[no-untyped-def]
            unittest.TestCase.assertEqual(self, a.size(), b.size(), message)
            if exact_dtype:
                unittest.TestCase.assertEqual(self, a.dtype, b.dtype)
            if a.numel() == 0:
                return
            a = a.detach().cpu()
            if a.dtype in (torch.float16, torch.bfloat16):
                a = a.to(torch.float32)
            b = b.detach().cpu().to(a)
            if (a.dtype == torch.bool) != (b.dtype == torch.bool):
                raise TypeError("Was expecting both tensors to be bool type.")
            if a.dtype == torch.bool:
                a, b = a.to(torch.int), b.to(torch.int)
            diff = a - b
            if a.dtype.is_floating_point or a.dtype.is_complex:
                nan = torch.isnan(a)
                self.assertTrue(torch.equal(nan, torch.isnan(b)), message)
                diff[nan] = 0
                if allow_inf:
                    inf = torch.isinf(a)
                    self.assertTrue(torch.equal(inf.sign(), torch.isinf(b).sign()), message)
                    diff[inf] = 0
            if diff.is_signed() and diff.dtype != torch.int8:
                diff = diff.abs()
                if diff.is_complex():
                    diff = diff.real
            self.assertLessEqual(diff.max(), prec, message)

        def assertEqual(self, x, y, prec=None, message="", allow_inf=False, exact_dtype=None):  # type: ignore[no-untyped-def]  # noqa: N802
            exact_dtype = self.exact_dtype if exact_dtype is None else exact_dtype
            if isinstance(prec, str) and message == "":
                message, prec = prec, None
            prec = self.precision if prec is None else prec
            base = unittest.TestCase.assertEqual

            def equal(x, y):  # type: ignore[no-untyped-def]
                if isinstance(x, torch.Tensor) and isinstance(y, Number):
                    equal(x.item(), y)
                elif isinstance(y, torch.Tensor) and isinstance(x, Number):
                    equal(x, y.item())
                elif isinstance(x, Number) and isinstance(y, Number):
                    if abs(x) == float("inf") or abs(y) == float("inf"):
                        if allow_inf:
                            base(self, x, y, message)
                        else:
                            self.fail(f"Expected finite numeric values - x={x}, y={y}")
                        return
                    self.assertLessEqual(abs(x - y), prec, message)
                elif isinstance(x, np.bool_) or isinstance(y, np.bool_):
                    base(self, bool(x), bool(y), message)
                elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                    base(self, x.is_sparse, y.is_sparse, message)
                    if x.is_sparse:
                        x, y = x.coalesce(), y.coalesce()
                        self._tensor_equal(x._indices(), y._indices(), message, exact_dtype, allow_inf, prec)
                        self._tensor_equal(x._values(), y._values(), message, exact_dtype, allow_inf, prec)
                    else:
                        self._tensor_equal(x, y, message, exact_dtype, allow_inf, prec)
                elif isinstance(x, (str, bytes)) and isinstance(y, (str, bytes)):
                    base(self, x, y, message)
                elif type(x) is set and type(y) is set:
                    base(self, x, y, message)
                elif isinstance(x, dict) and isinstance(y, dict):
                    if isinstance(x, OrderedDict) and isinstance(y, OrderedDict):
                        equal(list(x.items()), list(y.items()))
                    else:
                        equal(set(x.keys()), set(y.keys()))
                        keys = list(x.keys())
                        equal([x[k] for k in keys], [y[k] for k in keys])
                elif isinstance(x, Iterable) and isinstance(y, Iterable):
                    xs, ys = list(x), list(y)
                    base(self, len(xs), len(ys), message)
                    for a, b in zip(xs, ys, strict=True):
                        equal(a, b)
                else:
                    base(self, x, y, message)

            equal(x, y)

        def assertNotEqual(self, x, y, prec=None, message=""):  # type: ignore[no-untyped-def]  # noqa: N802
            if isinstance(prec, str) and message == "":
                message, prec = prec, None
            prec = self.precision if prec is None else prec
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.size() != y.size():
                    return
                self.assertGreater(x.numel(), 0)
                a, b = x.detach().cpu().double(), y.detach().cpu().double()
                self.assertGreaterEqual((a - b).abs().max().item(), prec, message)
            elif isinstance(x, Number) and isinstance(y, Number):
                self.assertGreaterEqual(abs(x - y), prec, message)
            else:
                unittest.TestCase.assertNotEqual(self, x, y, message)

        def assertAlmostEqual(self, x, y, places=None, msg=None, delta=None, allow_inf=None):  # type: ignore[no-untyped-def]  # noqa: N802
            prec = 10 ** (-places) if places else delta
            self.assertEqual(x, y, prec, msg or "", bool(allow_inf))

    own(module, [TestCase, run_tests])
    module.PERF_TEST_ENABLE = False  # type: ignore[attr-defined]


# -- common_distributed, decorator ---------------------------------------------------------------

def _common_distributed(module: types.ModuleType) -> None:
    TestSkip = namedtuple("TestSkip", "exit_code, message")  # noqa: N806, PYI024
    skips = {"multi-npu": TestSkip(75, "Multi-NPU condition not satisfied"),
             **{f"multi-npu-{n}": TestSkip(75, f"Need at least {n} ASCEND devices") for n in range(1, 9)},
             "hccl": TestSkip(76, "c10d not compiled with HCCL support"),
             "known_issues": TestSkip(77, "Test skipped due to known issues")}

    def skipIfUnsupportMultiNPU(npu_number_needed):  # type: ignore[no-untyped-def]  # noqa: N802
        def skip_dec(func):  # type: ignore[no-untyped-def]
            @functools.wraps(func)
            def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                npu = torch.npu  # type: ignore[attr-defined]
                if not npu.is_available() or npu.device_count() < npu_number_needed:
                    raise unittest.SkipTest(f"Multi-NPU {npu_number_needed} condition not satisfied")
                return func(self, *args, **kwargs)
            return wrapper
        return skip_dec

    own(module, [skipIfUnsupportMultiNPU])
    module.TestSkip = TestSkip  # type: ignore[attr-defined]
    module.TEST_SKIPS = skips  # type: ignore[attr-defined]


def _decorator(module: types.ModuleType) -> None:
    class Dtypes:
        """``@Dtypes(torch.float16, ...)``: the dtypes ``instantiate_tests`` makes tests for."""

        def __init__(self, *args):  # type: ignore[no-untyped-def]
            if not args:
                raise RuntimeError("No dtypes given")
            if not all(isinstance(a, torch.dtype) for a in args):
                raise RuntimeError(f"Unknown dtype in {args}")
            self.args = args

        def __call__(self, fn):  # type: ignore[no-untyped-def]
            fn.dtypes = self.args
            return fn

    class Formats:
        """``@Formats(0, 3, 29)``: the npu formats ``instantiate_tests`` makes tests for."""

        def __init__(self, *args):  # type: ignore[no-untyped-def]
            if not args:
                raise RuntimeError("No formats given")
            self.args = args

        def __call__(self, fn):  # type: ignore[no-untyped-def]
            fn.formats = self.args
            return fn

    def _feed(func: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def test(self):  # type: ignore[no-untyped-def]
            return func(self, **kwargs)
        test.__name__ = name
        return test

    def instantiate_tests(arg=None, **kwargs):  # type: ignore[no-untyped-def]
        """One test per combination of a method's ``Dtypes`` and ``Formats``, named
        ``<method>_<dtype>`` / ``<method>_<format>``; the template is removed."""
        cls = arg
        for name, func in list(cls.__dict__.items()):
            axes = {k: getattr(func, attr) for k, attr in (("dtype", "dtypes"), ("format", "formats"))
                    if hasattr(func, attr)}
            if not axes:
                continue
            params = inspect.getfullargspec(func).args
            for values in itertools.product(*axes.values()):
                new_kwargs: dict[str, Any] = {"device": "npu"} if "device" in params else {}
                test_name = name
                for key, value in zip(axes, values, strict=True):
                    test_name += "_" + (str(value).split(".")[1] if key == "dtype" else str(value))
                    matches = [p for p in params if key in p]
                    if len(matches) > 1:
                        raise RuntimeError(f"Multiple matches for {key}")
                    new_kwargs[matches[0] if matches else key] = value
                setattr(cls, test_name, _feed(func, test_name, new_kwargs))
            delattr(cls, name)
        return cls

    own(module, [Dtypes, Formats, instantiate_tests])


def _package(module: types.ModuleType) -> None:
    module.__doc__ = ("opcontracts emulation of torch_npu.testing (the helpers torch_npu's op "
                      "tests import: testcase, common_utils, common_distributed, decorator).")


TABLE: dict[str, Callable[[types.ModuleType], None]] = {
    "torch_npu.testing": _package,
    "torch_npu.testing.common_utils": _common_utils,
    "torch_npu.testing.testcase": _testcase,
    "torch_npu.testing.common_distributed": _common_distributed,
    "torch_npu.testing.decorator": _decorator,
}
"""Stand-in module name -> the function that fills it (``_surface``)."""
