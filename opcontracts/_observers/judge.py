"""How an op's result is judged against its reference: msprobe's accuracy-checker rules.

Credit: the numbers and the order of the tests are those of msprobe's API accuracy checker
(Ascend/msprobe, ``api_accuracy_checker/compare/algorithm.py`` and ``compare.py``, the standard
its docs and ``api_precision_standard.yaml`` describe; gathered in the project's
``wheels-compare-coverage.md``, section 2).  For a floating output, against a reference computed
on up-cast inputs (fp16/bf16 -> fp32, fp32 -> fp64):

1. cosine similarity must exceed 0.99 (both all-zero passes; one all-zero fails);
2. a maximum absolute error below 0.001 passes outright;
3. fp16 / bf16: more than 99% of the elements within 1% relative error ("dual-100"), else an
   error; more than 99.9% within 0.1% ("dual-1000"), else a warning;
   fp32 / fp64: more than 99.9% within 0.1% ("dual-1000"), else an error; more than 99.99%
   within 0.01% ("dual-10000"), else a warning.

Relative error is ``|out - ref| / (|ref| + eps)`` with the reference dtype's ``eps``, as msprobe
computes it.  Integer and bool outputs (indices, masks) must match exactly ("error rate" 0).
A non-finite element where the reference, rounded to the output's dtype, is finite (or the
other way round, or a different NaN/inf) is an error: msprobe judges finiteness the same way.
Warnings are counted, not reported as divergences.

The small-value thresholds and the benchmark/ULP standards msprobe applies to chosen APIs are
not used: they need per-API tables (and a GPU-vs-CPU baseline for the benchmark standard).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

__all__ = ["SOURCE", "Judged", "Measured", "Thresholds", "Verdict", "judge", "measure",
           "thresholds_for"]

SOURCE = ("msprobe API accuracy checker (Ascend/msprobe, api_accuracy_checker/compare: cosine > "
          "0.99; max abs error < 0.001 passes; dual-100/1000 for fp16/bf16, dual-1000/10000 "
          "for fp32/fp64)")

Status = Literal["pass", "warning", "error"]


@dataclass(frozen=True)
class Thresholds:
    """What one output was judged against, and where the numbers come from."""

    dtype: str
    cosine: float | None = 0.99          # must exceed (None: not used, index outputs)
    max_abs_pass: float | None = 0.001   # below: passes outright
    error_rel: float | None = None       # relative error bound of the error test ...
    error_share: float | None = None     # ... the share of elements that must stay within it
    warn_rel: float | None = None
    warn_share: float | None = None
    exact: bool = False                  # index / bool outputs: every element equal
    source: str = SOURCE

    def describe(self) -> str:
        if self.exact:
            return f"{self.dtype}: every element equal (index output)"
        parts = [f"cosine > {self.cosine}", f"max abs error < {self.max_abs_pass} passes"]
        if self.error_rel is not None and self.error_share is not None:
            parts.append(f"else > {_pct(self.error_share)} of elements within "
                         f"{_pct(self.error_rel)} relative error")
        if self.warn_rel is not None and self.warn_share is not None:
            parts.append(f"warn below {_pct(self.warn_share)} within {_pct(self.warn_rel)}")
        return f"{self.dtype}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


_LOW = (torch.float16, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def thresholds_for(dtype: torch.dtype) -> Thresholds:
    """msprobe's rule for an output of ``dtype``."""
    name = _name(dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        return Thresholds(name, cosine=None, max_abs_pass=None, exact=True)
    if dtype in _LOW:
        return Thresholds(name, error_rel=0.01, error_share=0.99, warn_rel=0.001,
                          warn_share=0.999)
    return Thresholds(name, error_rel=0.001, error_share=0.999, warn_rel=0.0001,
                      warn_share=0.9999)


@dataclass
class Verdict:
    """The outcome for one output (or one input's gradient)."""

    status: Status
    reason: str
    thresholds: Thresholds
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Measured:
    """An output measured against its reference on the device, not read yet: ``vector`` holds
    every number the rules need (``_FIELDS`` for a floating output, the count of unequal
    elements for an index one); ``verdict`` turns the numbers, once read, into a ``Verdict``."""

    thresholds: Thresholds
    vector: torch.Tensor
    numel: int

    def verdict(self, numbers: list[float]) -> Verdict:
        return _verdict(self, numbers)


Judged = Verdict | Measured


def judge(actual: torch.Tensor, expected: torch.Tensor) -> Verdict:
    """Judge ``actual`` (the op's output, any device) against ``expected`` (the reference's,
    at a higher precision); neither is modified.  One host read (``measure`` then the read)."""
    m = measure(actual, expected)
    if isinstance(m, Verdict):
        return m
    return m.verdict(m.vector.tolist())


# the numbers of a floating output's vector, in order
_FIELDS = ("ok", "n_both", "max_abs", "max_rel", "h", "t", "tt", "dot", "uu", "vv", "amax",
           "emax")


def measure(actual: torch.Tensor, expected: torch.Tensor) -> Judged:
    """Everything the rules read, computed on the device without reading anything (a verdict
    right away only for what needs no number: a shape mismatch, an empty output).

    No data-dependent shapes (boolean indexing synchronises): an element is *ok* when it is
    finite on both sides or non-finite alike on both (the same inf, or NaN and NaN); the
    elements not finite on both sides are zeroed (``nan_to_num``) for the metrics, which then
    are the finite elements' whenever every element is ok (else the verdict is an error
    anyway), and the shares leave them out.  The metrics are those of judging with a read per
    output, to the bit.  Read the vector (with the step's others, in one transfer:
    ``_observers.deferred``) and call ``Measured.verdict``."""
    th = thresholds_for(actual.dtype)
    a = actual.detach().to(expected.device)
    e = expected.detach()
    if tuple(a.shape) != tuple(e.shape):
        return Verdict("error", f"shape {tuple(a.shape)}, the reference gives {tuple(e.shape)}",
                       th, {})
    n = a.numel()
    if th.exact:
        if not n:
            return Verdict("pass", "equal", th, {"error_rate": 0.0})
        return Measured(th, (a != e.to(a.dtype)).sum().reshape(1), n)
    if n == 0:
        return Verdict("pass", "empty", th, {})
    work = torch.float64 if e.dtype == torch.float64 else torch.float32
    af, ef = a.to(work), e.to(work)
    fin_a = _finite(af)
    fin_e = _finite(e.to(a.dtype)) if e.dtype != a.dtype else _finite(ef)
    both = fin_a & fin_e
    ok = both | (af == ef) | (torch.isnan(af) & torch.isnan(ef))  # or the same inf, or NaNs
    af, ef = torch.nan_to_num(af, 0.0, 0.0, 0.0), torch.nan_to_num(ef, 0.0, 0.0, 0.0)
    eps = torch.finfo(e.dtype if e.dtype.is_floating_point else work).eps
    abs_err = (af - ef).abs()
    e_abs = ef.abs()
    rel = abs_err / (e_abs + eps)
    na, ne = af.abs().amax(), e_abs.amax()
    scale = torch.maximum(na, ne).clamp_min(torch.finfo(work).tiny)
    u, v = af / scale, ef / scale  # scaled first, as msprobe does: no overflow in the sums
    # the five counts in one reduction (counted as integers: exact)
    counts = torch.stack([ok, both, rel < 0.01, rel < 0.001, rel < 0.0001]).reshape(5, -1) \
        .sum(1).to(work)
    vec = torch.cat([counts[:2], torch.stack([abs_err.amax(), rel.amax()]), counts[2:],
                     torch.stack([(u * v).sum(), (u * u).sum(), (v * v).sum(), na, ne])])
    return Measured(th, vec, n)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` in one kernel: ``|x| < inf`` is False exactly for NaN and +-inf
    (``isfinite`` is composite on floating tensors: ~2x slower on the CPU)."""
    return x.abs() < math.inf


def _verdict(m: Measured, numbers: list[float]) -> Verdict:
    """msprobe's rules on the numbers ``measure`` left on the device."""
    th, n = m.thresholds, m.numel
    if th.exact:
        wrong = int(numbers[0])
        rate = {"error_rate": wrong / n}
        if wrong:
            return Verdict("error", f"{wrong} of {n} elements differ (index output: every "
                           "element must be equal)", th, rate)
        return Verdict("pass", "equal", th, rate)
    f = dict(zip(_FIELDS, numbers))
    bad_fin, n_both = n - int(f["ok"]), int(f["n_both"])
    if bad_fin:
        return Verdict("error", f"{bad_fin} of {n} elements non-finite where the "
                       "reference is finite (or the other way round)", th,
                       {"nonfinite_mismatch": bad_fin})
    if n_both == 0:
        return Verdict("pass", "no finite elements; non-finite ones agree", th, {})
    k, zeroed = float(n_both), n - n_both  # the zeroed elements count as within every bound
    met = {"max_abs": f["max_abs"], "max_rel": f["max_rel"],
           "rel_err_hundredth": (f["h"] - zeroed) / k,
           "rel_err_thousandth": (f["t"] - zeroed) / k,
           "rel_err_ten_thousandth": (f["tt"] - zeroed) / k,
           "cosine": _cosine(f["dot"], f["uu"], f["vv"], f["amax"], f["emax"], n_both)}
    cos = met["cosine"]
    assert th.cosine is not None and th.max_abs_pass is not None
    if not cos > th.cosine:
        return Verdict("error", f"cosine similarity {cos:.4g}, needs > {th.cosine}", th, met)
    if met["max_abs"] < th.max_abs_pass:
        return Verdict("pass", f"max abs error {met['max_abs']:.3g} < {th.max_abs_pass}", th,
                       met)
    assert th.error_rel is not None and th.error_share is not None
    assert th.warn_rel is not None and th.warn_share is not None
    share = met[_SHARE[th.error_rel]]
    if not share > th.error_share:
        return Verdict("error", f"{_pct(share)} of elements within {_pct(th.error_rel)} relative "
                       f"error, needs > {_pct(th.error_share)}", th, met)
    warn = met[_SHARE[th.warn_rel]]
    if not warn > th.warn_share:
        return Verdict("warning", f"{_pct(warn)} of elements within {_pct(th.warn_rel)}, "
                       f"msprobe warns below {_pct(th.warn_share)}", th, met)
    return Verdict("pass", f"{_pct(warn)} of elements within {_pct(th.warn_rel)}", th, met)


_SHARE = {0.01: "rel_err_hundredth", 0.001: "rel_err_thousandth",
          0.0001: "rel_err_ten_thousandth"}


def _cosine(dot: float, uu: float, vv: float, amax: float, emax: float, n: int) -> float:
    """msprobe's cosine: 1 for one element or two all-zero tensors, 0 when only one is zero."""
    if n == 1:
        return 1.0
    tiny = torch.finfo(torch.float64).eps
    if amax <= tiny and emax <= tiny:
        return 1.0
    if amax <= tiny or emax <= tiny:
        return 0.0
    cos = dot / math.sqrt(uu * vv) if uu > 0 and vv > 0 else 0.0
    return cos if math.isfinite(cos) else 0.0
