"""Helios against PyTorch's own op samples: the OpInfo database (``op_db``).

Mapping.  Every OpInfo whose name, aten name or alias names a Helios function or Tensor
method (``helios.<name>``, ``helios.functional.<name>``, ``helios.creation.<name>`` or
``Tensor.<name>``; ``nn.functional.``, ``special.`` and ``linalg.`` names by their last part)
joins the walk, so an op added to Helios under PyTorch's name is walked from then on.
``NOT_THE_SAME`` lists the names Helios uses with another meaning, ``ADAPTERS`` the OpInfos
whose op calls PyTorch with its arguments reordered.

Samples.  For each dtype Helios has (float32, float16, bfloat16, int32, int64, bool) that the
OpInfo supports, each CPU sample is converted to Helios tensors of the same values, shape and
strides (gradients where the sample asks for them); float32 samples run a second time as
non-contiguous views (``SampleInput.noncontiguous``).  PyTorch dtypes become Helios dtypes
(one Helios lacks, by its name), the test device ``"cpu"`` becomes Helios' device, memory
formats and layouts go by name.  A sample holding a tensor of a dtype Helios has no tensor of
is not run (counted as such).  At most ``MAX_SAMPLES`` samples per op and dtype run.

Comparison.  Forward: shapes, dtypes and values (NaN and infinities in the same places).
Backward: the gradient of a weighted sum ``sum_i sum(out_i * w_i)`` (fixed random weights)
with respect to every input that requires grad.  Tolerances per dtype are in ``TOL``
(gradients ``GRAD_SCALE`` times looser).  Random or uninitialised results (``RANDOM_OPS``)
are checked for shape, dtype and, for dropout, the mask-and-scale structure.

The float64 oracle rule.  A float value that differs from PyTorch float32 beyond the
tolerance is compared again with PyTorch float64 run on the same inputs (float32 values, so
exact in float64), and passes if it is within the tolerance of that: where PyTorch's float32
result is the less exact one (cancellation, float16 intermediates that overflow, another
summation order), float64 decides.

Refusals.  Samples Helios deliberately does not accept are listed in ``REFUSALS`` with the
reason; each must raise the listed Helios error type with a message (an entry whose sample
now works fails the test: remove it).  Any other exception, any Helios error not in the
table, and any mismatch fails the op's test, with one line per failing sample naming the op,
dtype, sample index and arguments.

Report.  The last test prints per-op counts (passed, refused, failed, not run, capped) and
the OpInfos with no Helios equivalent; ``HELIOS_OPINFO_REPORT=path`` writes the Markdown page
kept in ``tests/opinfo_coverage.md`` (``HELIOS_OPINFO_REPORT_UNMAPPED=1`` also counts the
unmapped OpInfos' float32 samples, which takes a while).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from torch.testing._internal import common_utils as torch_common_utils
from torch.testing._internal.common_methods_invocations import op_db  # needs the expecttest package

import helios as hl
import helios.functional as F
from helios.errors import DTypeError, HeliosError, ShapeError
from helios.tensor import Tensor

pytestmark = pytest.mark.vulkan

# -- what is compared, and how closely -----------------------------------------------------------
# (rtol, atol) of forward values; gradients get GRAD_SCALE times as much.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
GRAD_SCALE = 4
MAX_SAMPLES = 100  # per op and dtype (the walk's time budget; "capped" in the report counts what is left out)

HL_DTYPE = {torch.float32: hl.float32, torch.float16: hl.float16, torch.bfloat16: hl.bfloat16, torch.int32: hl.int32,
            torch.int64: hl.int64, torch.bool: hl.bool}
TORCH_DTYPE = {v.name: k for k, v in HL_DTYPE.items()}
WALKED_DTYPES = tuple(HL_DTYPE)


# -- the one table of deliberate refusals ---------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """Samples of ``op`` (``variant``: an OpInfo variant_test_name, None = any) for which
    ``when(sample, dtype)`` holds must raise ``error`` (a Helios error) for ``reason``."""

    op: str
    variant: str | None
    when: Callable
    error: type
    reason: str


def _has_dtype(s, d) -> bool:
    def walk(x):
        if isinstance(x, torch.dtype):
            return x not in HL_DTYPE
        if isinstance(x, (list, tuple)):
            return any(walk(y) for y in x)
        if isinstance(x, dict):
            return any(walk(y) for y in x.values())
        return False

    return walk(s.args) or walk(s.kwargs)


def _channels_last(s, d) -> bool:
    return str(s.kwargs.get("memory_format", "")) == "torch.channels_last"


def _int_dtype(s, d) -> bool:
    return not d.is_floating_point


REFUSALS: list[Refusal] = [
    Refusal("*", None, _has_dtype, DTypeError, "asks for a dtype Helios does not have (float64, complex, int8/16, uint8)"),
    Refusal("*", None, _channels_last, ShapeError,
            "memory_format=channels_last: Helios results are row-major (contiguous_format); permute for another layout"),
    Refusal("matmul", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("__rmatmul__", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("nn.functional.linear", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("mm", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("bmm", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("addmm", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("baddbmm", None, _int_dtype, DTypeError, "integer matmul: the matmul kernels are floating-point only"),
    Refusal("norm", "nuc", lambda s, d: True, ShapeError, "the nuclear norm needs a singular value decomposition"),
]


def _refusal(op, sample, dtype) -> Refusal | None:
    for r in REFUSALS:
        if r.op in ("*", op.name) and (r.variant is None or r.variant == op.variant_test_name) and r.when(sample, dtype):
            return r
    return None


# -- mapping an OpInfo to Helios ------------------------------------------------------------------
# Namespaces of PyTorch whose functions mean the same as Helios' of the same last name.
SAME_MEANING_PREFIXES = ("nn.functional.", "special.", "linalg.")
# Where Helios holds the ops: the top level, helios.functional (and its modules) and
# helios.creation (not the helpers they import, such as helios._shape.broadcast_shapes).
HELIOS_MODULES = ("helios.functional", "helios.creation")

# OpInfos whose name Helios has with another meaning: not mapped.
NOT_THE_SAME = {
    "scalar_tensor": "helios.functional.scalar_tensor is the ops' cache of constants (value, dtype, runtime)",
    "uniform": "the OpInfo is Tensor.uniform_ (in place); helios.uniform(low, high, shape) makes a new tensor",
    "normal[in_place]": "the OpInfo is Tensor.normal_ (in place); helios.normal makes a new tensor",
    "linalg.norm": "torch.linalg.norm's ord is a matrix norm on 2-D inputs; helios.norm is torch.norm (vector p-norms, 'fro')",
    "linalg.norm[subgradients_at_zero]": "torch.linalg.norm (see linalg.norm); helios.norm is torch.norm",
}

# OpInfos whose op calls the PyTorch function with its arguments reordered: the same call in Helios.
ADAPTERS = {
    "where": lambda x, cond, other, **kw: hl.where(cond, x, other, **kw),
    "nn.functional.embedding": lambda w, idx, **kw: F.embedding(idx, w, **kw),
    "normal[number_mean]": lambda std, mean, *a, **kw: hl.normal(mean, std, *a, **kw),
    "zero_": lambda x: F.zero_(F.clone(x)),
    "einsum": lambda tensors, equation: hl.einsum(equation, tensors),
}


# Ops whose ties PyTorch orders arbitrarily (stable=False) and Helios stably: the reference is
# PyTorch's stable sort, so indices (and the gradients they route) are compared exactly.
def _stable_sort(x, dim=-1, descending=False, stable=None, **kw):
    return torch.sort(x, stable=True, dim=dim, descending=descending, **kw)


def _stable_topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64)
    v, i = torch.sort(x, stable=True, dim=dim, descending=largest)
    return v.narrow(dim, 0, k), i.narrow(dim, 0, k)


TORCH_REFERENCE = {
    "sort": _stable_sort,
    "argsort": lambda x, dim=-1, descending=False, stable=None: _stable_sort(x, dim, descending).indices,
    "msort": lambda x: _stable_sort(x, 0).values,
    "topk": _stable_topk,
}


def _in_mro(name: str) -> bool:
    return any(name in k.__dict__ for k in Tensor.__mro__ if k is not object)


def _lookup(name: str):
    """The Helios callable of OpInfo name ``name``: fn(input, *args, **kwargs), or None."""
    if name.startswith("__") and name.endswith("__"):
        if not _in_mro(name):
            return None
        return lambda x, *a, **k: getattr(Tensor, name)(x, *a, **k)
    short = name
    for prefix in SAME_MEANING_PREFIXES:
        if name.startswith(prefix):
            short = name[len(prefix):]
    if "." in short:
        return None
    for ns in (hl, F):
        f = getattr(ns, short, None)
        module = getattr(f, "__module__", "") or ""
        if callable(f) and not isinstance(f, type) and any(module == m or module.startswith(m + ".") for m in HELIOS_MODULES):
            return f
    if not _in_mro(short):
        return None
    attr = next(k.__dict__[short] for k in Tensor.__mro__ if short in k.__dict__)
    if isinstance(attr, property):
        return lambda x: getattr(x, short)
    if callable(attr):
        return lambda x, *a, **k: getattr(x, short)(*a, **k)
    return None


def helios_fn(op):
    """(callable, the name it was found under), or (None, None) for an op Helios does not have."""
    oid = _op_id(op)
    if oid in NOT_THE_SAME:
        return None, None
    for name in (op.name, getattr(op, "aten_name", None), *(a.name for a in op.aliases)):
        if name:
            f = _lookup(name)
            if f is not None:
                return ADAPTERS.get(oid, ADAPTERS.get(op.name, f)), name
    return None, None


def _op_id(op) -> str:
    return op.name + (f"[{op.variant_test_name}]" if op.variant_test_name else "")


MAPPED = [op for op in op_db if helios_fn(op)[0] is not None]
UNMAPPED = [op for op in op_db if helios_fn(op)[0] is None]


# -- converting a sample --------------------------------------------------------------------------
class _Unsupported(Exception):
    """A sample that uses a dtype Helios has no tensor of (it stays out of the walk)."""


def _helios_tensor(t: torch.Tensor, grad: bool) -> Tensor:
    """A Helios leaf with ``t``'s values, shape and strides."""
    if t.dtype not in HL_DTYPE:
        raise _Unsupported(str(t.dtype))
    d = HL_DTYPE[t.dtype]
    t = t.detach()
    if t.is_contiguous():
        h = hl.tensor(t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), dtype=d)
    else:
        # Upload the storage span the view reads, then view it with the same strides.
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
        flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
        base = hl.tensor(flat.float().numpy() if t.dtype == torch.bfloat16 else flat.numpy(), dtype=d)
        h = Tensor(base._st, tuple(t.shape), tuple(t.stride()), 0, d)
    if grad:
        h.requires_grad_(True)
    return h


def _convert(x, grad_dtypes, hl_leaves, th_leaves, t64_leaves):
    """(helios value, torch value, torch float64 value) of a sample argument."""
    if isinstance(x, torch.Tensor):
        grad = x.requires_grad and x.dtype in grad_dtypes and x.dtype.is_floating_point  # as the sample asks
        h = _helios_tensor(x, grad)
        t = x.detach().clone(memory_format=torch.preserve_format) if x.is_contiguous() else x.detach()
        t = t.requires_grad_(grad)
        t64 = (x.detach().to(torch.float64) if x.dtype.is_floating_point else x.detach()).requires_grad_(grad)
        if grad:
            hl_leaves.append(h)
            th_leaves.append(t)
            t64_leaves.append(t64)
        return h, t, t64
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        parts = [_convert(y, grad_dtypes, hl_leaves, th_leaves, t64_leaves) for y in x]
        return tuple(type(x)(p[i] for p in parts) for i in range(3))
    if isinstance(x, torch.Size):
        return tuple(x), x, x
    if isinstance(x, dict):
        parts = {k: _convert(v, grad_dtypes, hl_leaves, th_leaves, t64_leaves) for k, v in x.items()}
        return tuple({k: p[i] for k, p in parts.items()} for i in range(3))
    if isinstance(x, torch.dtype):
        h = HL_DTYPE[x] if x in HL_DTYPE else str(x).replace("torch.", "")
        return h, x, (torch.float64 if x.is_floating_point else x)
    if isinstance(x, torch.device) or (isinstance(x, str) and x == "cpu"):
        return hl.current_device(), x, x  # the device under test is Helios' device
    if isinstance(x, (torch.memory_format, torch.layout)):
        return str(x).replace("torch.", ""), x, x  # by name: Helios does not import torch
    return x, x, x


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        nc = "" if x.is_contiguous() else f" strides={tuple(x.stride())}"
        return f"tensor{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}{nc}"
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        inner = ", ".join(_describe(y) for y in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_describe(v)}" for k, v in x.items()) + "}"
    return repr(x)


def describe_sample(s) -> str:
    args = ", ".join([_describe(s.input)] + [_describe(a) for a in s.args] + [f"{k}={_describe(v)}" for k, v in s.kwargs.items()])
    return f"({args})" + (f" '{s.name}'" if s.name else "")


# -- comparing ------------------------------------------------------------------------------------
def _flatten_out(o) -> list:
    if isinstance(o, (list, tuple)):
        return [y for x in o for y in _flatten_out(x)]
    return [o]


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    if isinstance(x, Tensor):
        return x.numpy()
    return np.asarray(x)


def _close(h: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    h, ref = h.astype(np.float64), ref.astype(np.float64)
    same = (h == ref) | (np.isnan(h) & np.isnan(ref))
    finite = np.isfinite(h) & np.isfinite(ref)
    with np.errstate(invalid="ignore", over="ignore"):
        return same | (finite & (np.abs(h - ref) <= atol + rtol * np.abs(ref)))


def _compare(what: str, h, t, t64, scale: float = 1.0) -> str | None:
    """None if Helios' ``h`` matches torch's ``t`` (float32 or float64 rule), else why not."""
    if isinstance(t, torch.Tensor):
        if not isinstance(h, Tensor):
            return f"{what}: Helios gave {type(h).__name__}, PyTorch a tensor"
        if tuple(h.shape) != tuple(t.shape):
            return f"{what}: shape {tuple(h.shape)}, PyTorch {tuple(t.shape)}"
        if TORCH_DTYPE.get(h.dtype.name) != t.dtype:
            return f"{what}: dtype {h.dtype.name}, PyTorch {str(t.dtype).replace('torch.', '')}"
    elif isinstance(h, Tensor):
        return f"{what}: Helios gave a tensor, PyTorch {type(t).__name__} {t!r}"
    hv, tv = _np(h), _np(t)
    if not t.dtype.is_floating_point if isinstance(t, torch.Tensor) else not isinstance(t, float):
        if hv.shape != tv.shape or not np.array_equal(hv, tv):
            bad = np.argwhere(hv != tv)[:3].tolist() if hv.shape == tv.shape else "shape"
            return f"{what}: values differ at {bad}: Helios {hv.ravel()[:6]}, PyTorch {tv.ravel()[:6]}"
        return None
    rtol, atol = TOL.get(t.dtype, TOL[torch.float32]) if isinstance(t, torch.Tensor) else TOL[torch.float32]
    rtol, atol = rtol * scale, atol * scale
    ok = _close(hv, tv, rtol, atol)
    if ok.all():
        return None
    r64 = _np(t64) if t64 is not None else None
    if r64 is not None and r64.shape == hv.shape and _close(hv, r64, rtol, atol).all():
        return None  # float32 PyTorch is the less exact one here
    i = tuple(np.argwhere(~ok)[0])
    n = int((~ok).sum())
    ref64 = f", float64 {r64[i]!r}" if r64 is not None and r64.shape == hv.shape else ""
    return (f"{what}: {n} of {ok.size} values differ; first at {[int(j) for j in i]}: Helios {hv[i]!r}, "
            f"PyTorch {tv[i]!r}{ref64} (rtol {rtol}, atol {atol})")


# -- running one sample ---------------------------------------------------------------------------
def _torch_call(op, inp, args, kwargs):
    """PyTorch's result for OpInfo ``op`` (its TORCH_REFERENCE where it has one)."""
    return TORCH_REFERENCE.get(op.name, op.op)(inp, *args, **kwargs)


def _weights(outs, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(o.shape)).astype(np.float32) if isinstance(o, torch.Tensor) else None for o in outs]


def _weighted_sum_torch(outs, ws):
    total = None
    for o, w in zip(outs, ws):
        if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point:
            term = (o * torch.from_numpy(w).to(o.dtype)).sum()
            total = term if total is None else total + term
    return total


def _weighted_sum_helios(outs, touts, ws):
    total = None
    for o, t, w in zip(outs, touts, ws):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point and isinstance(o, Tensor):
            term = (o * hl.tensor(w, dtype=o.dtype)).sum()
            total = term if total is None else total + term
    return total


def run_sample(op, fn, sample, dtype, index: int) -> tuple[str, str | None]:
    """('pass' | 'refused' | 'fail' | 'skip', failure message or None) of one sample."""
    grad_dtypes = set(op.supported_backward_dtypes("cpu")) if op.supports_autograd else set()
    hl_leaves, th_leaves, t64_leaves = [], [], []
    try:
        (h_in, h_args, h_kw), (t_in, t_args, t_kw), (r_in, r_args, r_kw) = _convert(
            (sample.input, tuple(sample.args), dict(sample.kwargs)), grad_dtypes, hl_leaves, th_leaves, t64_leaves)
    except _Unsupported:
        return "skip", None
    refusal = _refusal(op, sample, dtype)
    try:
        t_out = _torch_call(op, t_in, t_args, t_kw)
    except Exception:
        return "skip", None  # PyTorch itself rejects the sample (not one OpInfo means to run)
    random_check = RANDOM_OPS.get(_op_id(op))
    if random_check is not None and not RANDOM_WHEN.get(_op_id(op), lambda a, k: True)(sample.args, sample.kwargs):
        random_check = None
    try:
        h_out = fn(h_in, *h_args, **h_kw)
        if refusal is None:
            # make errors raised at read-back time surface here, inside the sample
            for o in _flatten_out(h_out):
                if isinstance(o, Tensor):
                    o.numpy()
    except Exception as e:  # noqa: BLE001 - classify every error
        if refusal is not None and isinstance(e, refusal.error) and isinstance(e, HeliosError) and str(e):
            return "refused", None
        kind = "a Helios error not in REFUSALS" if isinstance(e, HeliosError) else "an untyped error"
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
        return "fail", f"raised {kind}: {type(e).__name__}: {e}\n{tb}"
    if refusal is not None:
        return "fail", f"is listed in REFUSALS ({refusal.reason}) but Helios accepted it: remove the entry"
    # reference in float64 for the oracle rule (only if any float tensors are involved)
    t64_out = None
    with contextlib.suppress(Exception):
        t64_out = _torch_call(op, r_in, r_args, r_kw)
    h_flat, t_flat = _flatten_out(h_out), _flatten_out(t_out)
    t64_flat = _flatten_out(t64_out) if t64_out is not None else [None] * len(t_flat)
    if len(t64_flat) != len(t_flat):
        t64_flat = [None] * len(t_flat)
    if len(h_flat) != len(t_flat):
        return "fail", f"forward: {len(h_flat)} outputs, PyTorch {len(t_flat)}"
    if random_check is not None:
        msg = random_check(h_in, h_args, h_kw, h_flat, t_flat)
        return ("fail", msg) if msg else ("pass", None)
    for k, (h, t, r) in enumerate(zip(h_flat, t_flat, t64_flat)):
        if not isinstance(t, torch.Tensor) and isinstance(h, Tensor) and h.ndim == 0:
            h = h.item()
        msg = _compare(f"forward output {k}", h, t, r)
        if msg:
            return "fail", msg
    if not th_leaves:
        return "pass", None
    ws = _weights(t_flat, index + 1)
    t_loss = _weighted_sum_torch(t_flat, ws)
    if t_loss is None:
        return "pass", None
    try:
        h_loss = _weighted_sum_helios(h_flat, t_flat, ws)
        if h_loss is None:
            return "fail", "backward: no Helios output carries a gradient"
        h_loss.backward()
        for h in hl_leaves:
            if h.grad is not None:
                h.grad.numpy()
    except Exception as e:  # noqa: BLE001
        kind = "a Helios error" if isinstance(e, HeliosError) else "an untyped error"
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
        return "fail", f"backward raised {kind}: {type(e).__name__}: {e}\n{tb}"
    t_grads = torch.autograd.grad(t_loss, th_leaves, allow_unused=True)
    r_grads = [None] * len(t_grads)
    with contextlib.suppress(Exception):
        r_loss = _weighted_sum_torch(t64_flat, ws)
        if r_loss is not None:
            r_grads = torch.autograd.grad(r_loss, t64_leaves, allow_unused=True)
    for k, (h, t, r) in enumerate(zip(hl_leaves, t_grads, r_grads)):
        if t is None:
            t = torch.zeros_like(th_leaves[k])
        if h.grad is None:
            if t.count_nonzero() == 0:
                continue
            return "fail", f"backward: input {k} has no gradient, PyTorch's is non-zero"
        msg = _compare(f"gradient of input {k}", h.grad, t, r, GRAD_SCALE)
        if msg:
            return "fail", msg
    return "pass", None


# -- random ops: compared by structure, not value -------------------------------------------------
def _check_dropout(h_in, h_args, h_kw, h_flat, t_flat):
    (h,) = h_flat
    x = h_in.numpy()
    y = h.numpy()
    p = h_kw.get("p", h_args[0] if h_args else 0.5)
    training = h_kw.get("training", True)
    if not training or p == 0:
        return None if np.array_equal(x, y) else "dropout: not the identity when not training or p == 0"
    if p == 1:
        return None if not y.any() else "dropout: p=1 left non-zeros"
    scaled = (x / (1 - p)).astype(y.dtype)
    ok = (y == 0) | np.isclose(y, scaled, rtol=1e-3, atol=1e-6)
    return None if ok.all() else "dropout: an element is neither 0 nor x / (1 - p)"


def _check_structure(h_in, h_args, h_kw, h_flat, t_flat):
    """Random or uninitialised results: the same shapes and dtypes, and finite values where
    PyTorch's are (random samples)."""
    for k, (h, t) in enumerate(zip(h_flat, t_flat)):
        if not isinstance(h, Tensor):
            return f"output {k}: Helios gave {type(h).__name__}, PyTorch a tensor"
        if tuple(h.shape) != tuple(t.shape) or TORCH_DTYPE.get(h.dtype.name) != t.dtype:
            return f"output {k}: {h.dtype.name} {tuple(h.shape)}, PyTorch {t.dtype} {tuple(t.shape)}"
    return None


def _check_random(h_in, h_args, h_kw, h_flat, t_flat):
    msg = _check_structure(h_in, h_args, h_kw, h_flat, t_flat)
    if msg is None:
        for k, (h, t) in enumerate(zip(h_flat, t_flat)):
            if t.dtype.is_floating_point and bool(torch.isfinite(t).all()) and not np.isfinite(h.numpy()).all():
                return f"output {k}: non-finite random samples"
    return msg


def _check_multinomial(h_in, h_args, h_kw, h_flat, t_flat):
    """Shape and dtype as PyTorch's; every index names a category of non-zero weight; without
    replacement, no index twice in a row."""
    msg = _check_structure(h_in, h_args, h_kw, h_flat, t_flat)
    if msg:
        return msg
    w = h_in.numpy().reshape(-1, h_in.shape[-1])
    idx = h_flat[0].numpy().reshape(w.shape[0], -1)
    if ((idx < 0) | (idx >= w.shape[1])).any():
        return "multinomial: an index is out of range"
    if not all((w[r, idx[r]] > 0).all() for r in range(w.shape[0])):
        return "multinomial: a category of zero weight was drawn"
    replacement = h_kw.get("replacement", h_args[1] if len(h_args) > 1 else False)
    if not replacement and any(len(set(row.tolist())) != len(row) for row in idx):
        return "multinomial: a category was drawn twice without replacement"
    return None


RANDOM_OPS = {"nn.functional.dropout": _check_dropout, "multinomial": _check_multinomial,
              "nn.functional.scaled_dot_product_attention": _check_structure, "randint": _check_structure,
              "randn": _check_random, "randn_like": _check_random,
              "rand_like": _check_random, "normal": _check_random, "normal[number_mean]": _check_random,
              "empty": _check_structure, "empty_like": _check_structure}


# Ops that are random only for some samples (compared by value otherwise).
RANDOM_WHEN = {"nn.functional.scaled_dot_product_attention": lambda args, kw: kw.get("dropout_p", 0.0) > 0}


# -- the walk -------------------------------------------------------------------------------------
RESULTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _has_tensor(s) -> bool:
    def walk(x):
        if isinstance(x, torch.Tensor):
            return x.numel() > 1
        if isinstance(x, (list, tuple)):
            return any(walk(y) for y in x)
        if isinstance(x, dict):
            return any(walk(y) for y in x.values())
        return False

    return walk(s.input) or walk(s.args) or walk(s.kwargs)


def _seed_cpu_generators(seed=None) -> None:
    """PyTorch's ``set_rng_seed`` for the generators its CPU samples draw from."""
    seed = torch_common_utils.SEED if seed is None else seed
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# PyTorch's sample iterator does two things per sample that cost more than the sample itself on
# pytest's deep stacks, and decide nothing here (replaced: this file 52 s -> 37 s on one core):
# - it looks for a unittest.TestCase up the stack (inspect.stack(): source lines of every frame)
#   to name the seed; under pytest there is none, so the seed is its default SEED either way;
# - it seeds with torch.manual_seed, which also queues a seed for each uninitialised accelerator
#   RNG (CUDA, XPU, MTIA) along with a formatted stack trace for each.
# The samples are the same, from the same CPU generator seeded the same way (checked by hashing
# the strided tensors and kwargs of every float32 and float16 sample of op_db's first 120 OpInfos
# both ways, and by the walk's per-op counts, which match tests/opinfo_coverage.md).
torch_common_utils.extract_test_fn = lambda: None
torch_common_utils.set_rng_seed = _seed_cpu_generators


def _dtypes(op) -> list:
    sup = op.supported_dtypes("cpu")
    return [d for d in WALKED_DTYPES if d in sup]


@pytest.mark.parametrize("op", MAPPED, ids=_op_id)
def test_opinfo(op):
    fn, _ = helios_fn(op)
    failures = []
    counts = RESULTS[_op_id(op)]
    counts.clear()
    for dtype in _dtypes(op):
        cap = MAX_SAMPLES
        req = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
        torch.default_generator.manual_seed(0)  # torch.manual_seed(0) on a CPU-only oracle, without its stack traces
        samples = op.sample_inputs("cpu", dtype, requires_grad=req)
        for i, s in enumerate(samples):
            if i >= cap:
                counts["capped"] += 1
                continue
            # float32 samples also run as non-contiguous views of the same values
            variants = [("", s)]
            if dtype == torch.float32 and _has_tensor(s):
                variants.append((" non-contiguous", s.noncontiguous()))
            for tag, v in variants:
                status, msg = run_sample(op, fn, v, dtype, i)
                counts[status] += 1
                if status == "fail":
                    failures.append(f"{_op_id(op)} {str(dtype).replace('torch.', '')} sample {i}{tag} {describe_sample(v)}: {msg}")
    if failures:
        pytest.fail(f"{len(failures)} failing samples:\n" + "\n".join(failures), pytrace=False)


def _report() -> str:
    """The coverage report: per-OpInfo counts, the refusals and the OpInfos not mapped."""
    cols = ("pass", "refused", "fail", "skip", "capped")
    lines = ["| OpInfo | passed | refused | failed | not run | capped |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    tot = collections.Counter()
    for name in sorted(RESULTS):
        c = RESULTS[name]
        tot.update(c)
        lines.append(f"| `{name}` | " + " | ".join(str(c[k]) for k in cols) + " |")
    lines.append(f"| **total** ({len(RESULTS)} OpInfos) | " + " | ".join(f"**{tot[k]}**" for k in cols) + " |")
    unmapped = sorted({_op_id(op) for op in UNMAPPED})
    if os.environ.get("HELIOS_OPINFO_REPORT_UNMAPPED") == "1":
        n = collections.Counter()
        for op in UNMAPPED:
            with contextlib.suppress(Exception):
                if torch.float32 in op.supported_dtypes("cpu"):
                    n[_op_id(op)] += sum(1 for _ in op.sample_inputs("cpu", torch.float32))
        body = ", ".join(f"`{k}` ({n[k]})" for k in unmapped)
        head = f"Not mapped: {len(unmapped)} OpInfos, {sum(n.values())} float32 samples (per OpInfo in brackets): "
    else:
        body = ", ".join(f"`{k}`" for k in unmapped)
        head = f"Not mapped: {len(unmapped)} OpInfos: "
    return "\n".join(lines) + "\n\n" + head + body + "\n"


def _report_doc(table: str) -> str:
    """The Markdown page kept in tests/opinfo_coverage.md."""
    refusals = "\n".join(f"| `{r.op}`{f' [{r.variant}]' if r.variant else ''} | {r.error.__name__} | {r.reason} |"
                         for r in REFUSALS)
    different = "\n".join(f"| `{k}` | {v} |" for k, v in NOT_THE_SAME.items())
    return f"""# OpInfo coverage

Written by `HELIOS_OPINFO_REPORT=tests/opinfo_coverage.md HELIOS_OPINFO_REPORT_UNMAPPED=1 pytest tests/test_opinfo.py`
(PyTorch {torch.__version__.split("+")[0]}); `tests/test_opinfo.py` says how samples are run and compared.  Columns
count samples over every dtype walked (float32 samples twice: as given and as non-contiguous
views): *passed* (forward and gradient match), *refused* (a deliberate refusal below, with its
Helios error), *failed*, *not run* (the sample holds a tensor of a dtype Helios has no tensor
of, e.g. a float64 `other` for `to`), *capped* (past the per-op sample cap).

## Deliberate refusals

| OpInfo | error | reason |
| --- | --- | --- |
{refusals}

## Same name, another meaning (not mapped)

| OpInfo | why |
| --- | --- |
{different}

## Per OpInfo

{table}"""


def test_coverage_report(capsys):
    """Print the per-op counts of the walk above (it runs after it: pytest keeps file order)."""
    if not RESULTS:
        pytest.skip("the OpInfo walk did not run in this session")
    table = _report()
    with capsys.disabled():
        print("\nOpInfo coverage (samples per OpInfo):\n" + table)
    path = os.environ.get("HELIOS_OPINFO_REPORT")
    if path:
        assert len(RESULTS) == len({_op_id(op) for op in MAPPED}), "write the report from a full walk (no -k)"
        with open(path, "w") as f:
            f.write(_report_doc(table))
    assert sum(c["pass"] for c in RESULTS.values()) > 0
