"""The op parity helper: run the same lambda on Helios and on PyTorch (CPU), compare
forward values and gradients.

``check(fn, *arrays)`` builds Helios tensors and torch tensors from the same numpy
arrays (float inputs require grad), calls ``fn(lib, *tensors)`` with ``lib`` the
module (``helios`` or ``torch``), compares outputs, then back-propagates the same
random upstream gradient and compares every input's gradient.  Tolerances are stated
per dtype in TOL.
"""

from __future__ import annotations

import numpy as np
import torch

import helios as hl

# (rtol, atol) per dtype of the compared values.
TOL = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "int32": (0, 0),
    "int64": (0, 0),
    "bool": (0, 0),
}

TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
               "int64": torch.int64, "bool": torch.bool}


def to_helios(a: np.ndarray, dtype: str, grad: bool, view=None):
    t = hl.tensor(a, dtype=dtype)
    if grad:
        t.requires_grad_(True)
    return t


def to_torch(a: np.ndarray, dtype: str, grad: bool):
    t = torch.tensor(a).to(TORCH_DTYPE[dtype])
    if grad:
        t.requires_grad_(True)
    return t


def _np(x):
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return x.numpy()


def assert_close(h, t, dtype: str, what: str, scale: float = 1.0):
    rtol, atol = TOL[dtype]
    hv, tv = _np(h), _np(t)
    assert hv.shape == tv.shape, f"{what}: shape {hv.shape} != torch {tv.shape}"
    if hv.dtype == np.bool_ or tv.dtype == np.bool_:
        np.testing.assert_array_equal(hv, tv, err_msg=what)
        return
    np.testing.assert_allclose(hv.astype(np.float64), tv.astype(np.float64), rtol=rtol * scale, atol=atol * scale,
                               err_msg=what, equal_nan=True)


def check(fn, *arrays, dtype: str = "float32", grad: bool = True, views=None, scale: float = 1.0, seed: int = 0):
    """Compare fn(hl, *xs) with fn(torch, *xs) forward and backward.

    ``views``: optional per-input functions applied to both libraries' tensors before
    ``fn`` (e.g. a transpose or a strided slice) to test non-contiguous inputs.
    """
    dtypes = [dtype if a.dtype.kind == "f" else {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32",
                                                  np.dtype(np.bool_): "bool"}[a.dtype] for a in arrays]
    needs = [grad and d in ("float32", "float16", "bfloat16") for d in dtypes]
    hs = [to_helios(a, d, g) for a, d, g in zip(arrays, dtypes, needs)]
    ts = [to_torch(a, d, g) for a, d, g in zip(arrays, dtypes, needs)]
    hv, tv = hs, ts
    if views:
        hv = [v(x) if v else x for v, x in zip(views, hs)]
        tv = [v(x) if v else x for v, x in zip(views, ts)]
    ho = fn(hl, *hv)
    to_ = fn(torch, *tv)
    out_dtype = str(to_.dtype).replace("torch.", "")
    assert_close(ho, to_, out_dtype if out_dtype in TOL else dtype, "forward", scale)
    if grad and any(needs) and to_.requires_grad:
        rng = np.random.default_rng(seed + 1)
        g = rng.standard_normal(to_.shape).astype(np.float32)
        ho.backward(hl.tensor(g, dtype=ho.dtype))
        to_.backward(torch.tensor(g).to(to_.dtype))
        for i, (h, t, n) in enumerate(zip(hs, ts, needs)):
            if n:
                if t.grad is None:
                    assert h.grad is None or np.allclose(h.grad.numpy(), 0), f"grad of input {i}: torch has none"
                    continue
                assert h.grad is not None, f"grad of input {i} is missing"
                assert_close(h.grad, t.grad, dtype, f"grad of input {i}", scale * 4)
    return ho, to_
