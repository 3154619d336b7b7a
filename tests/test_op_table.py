"""The elementwise op table (kernels_spirv/ew_ops.py): the generated GLSL is the committed one,
the host's op codes come from it, and every op in it computes what its entry says on the device."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest

from helios import _kernels as K
from helios.kernels_spirv import ew_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_generated_glsl_is_what_the_table_generates():
    with open(ew_ops.GEN_PATH) as f:
        committed = f.read()
    assert committed == ew_ops.generate(), "run `python kernels_spirv/build.py` and commit glsl/ew_ops.gen.glsl"


def test_codes_are_the_table_positions_and_the_host_takes_them():
    for kind, table in (("unary", K.UNARY), ("binary", K.BINARY), ("compare", K.COMPARE)):
        names = [op.name for op in ew_ops.OPS if op.kind == kind]
        assert len(set(names)) == len(names), f"a {kind} op is listed twice"
        assert table == {n: i for i, n in enumerate(names)}
    assert K.INT_UNARY == {"neg", "abs", "add_s", "mul_s", "rsub_s", "clamp"}
    for op in ew_ops.OPS:
        assert op.kind in ("unary", "binary", "compare") and op.dtypes, op
        assert op.bool_glsl is None or op.kind != "unary", op


def test_the_kernels_take_their_switch_from_the_generated_include():
    for kernel in ("ew_unary", "ew_binary"):
        with open(os.path.join(ROOT, "kernels_spirv", "glsl", kernel + ".comp")) as f:
            src = f.read()
        assert '#include "ew_ops.gen.glsl"' in src
        assert not re.search(r"OP == \d", src), f"{kernel}.comp has a hand-written op switch again"


def test_dead_op_codes_are_gone():
    names = {op.name for op in ew_ops.OPS}
    assert not names & {"square", "reciprocal", "affine"}


# numpy references of the float ops (x, y float64 arrays; p0, p1, alpha scalars)
def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_tanh_grad(x):
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)


_erf = np.vectorize(math.erf)
P0, P1, ALPHA = 0.75, 1.25, 0.5
UNARY_REF = {
    "neg": lambda x: -x, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
    "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "gelu_tanh": _gelu_tanh, "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), "abs": np.abs,
    "add_s": lambda x: x + P0, "mul_s": lambda x: x * P0, "pow_s": lambda x: x ** P0, "rsub_s": lambda x: P0 - x,
    "rdiv_s": lambda x: P0 / x, "clamp": lambda x: np.clip(x, P0, P1), "sin": np.sin, "cos": np.cos,
    "div_s": lambda x: x / P0,
}
BINARY_REF = {
    "add": lambda x, y: x + ALPHA * y, "sub": lambda x, y: x - ALPHA * y, "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y, "pow": lambda x, y: x ** y, "maximum": np.maximum, "minimum": np.minimum,
    "gelu_tanh_bwd": lambda x, y: y * _gelu_tanh_grad(x),
    "gelu_bwd": lambda x, y: y * (0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
    "sigmoid_bwd": lambda x, y: y * x * (1 - x), "tanh_bwd": lambda x, y: y * (1 - x * x),
    "relu_bwd": lambda x, y: np.where(x > 0, y, 0), "div_trunc": lambda x, y: np.trunc(x / y),
    "div_floor": lambda x, y: np.floor(x / y),
}
INT_REF = {"neg": lambda x: -x, "abs": np.abs, "add_s": lambda x: x + 3, "mul_s": lambda x: x * 3,
           "rsub_s": lambda x: 3 - x, "clamp": lambda x: np.clip(x, -2, 4)}


@pytest.mark.vulkan
def test_every_table_op_computes_its_entry_on_the_device():
    import helios as hl

    rng = np.random.default_rng(0)
    x = rng.uniform(0.25, 2.0, 37).astype(np.float32)  # positive: log, sqrt, pow are defined
    y = rng.uniform(0.25, 2.0, 37).astype(np.float32)
    tx, ty = hl.tensor(x), hl.tensor(y)
    float_ops = {op.name for op in ew_ops.OPS if op.glsl and op.kind != "compare"}
    assert float_ops == set(UNARY_REF) | set(BINARY_REF), "a table op without a reference here"
    for name, ref in UNARY_REF.items():
        got = K.unary(name, tx, P0, P1).numpy()
        np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=2e-6, atol=1e-6, err_msg=name)
    for name, ref in BINARY_REF.items():
        got = K.binary(name, tx, ty, ALPHA).numpy()
        np.testing.assert_allclose(got, ref(x.astype(np.float64), y.astype(np.float64)), rtol=2e-6, atol=1e-6,
                                   err_msg=name)
    xi = rng.integers(-6, 7, 29).astype(np.int32)
    ti = hl.tensor(xi)
    assert set(INT_REF) == K.INT_UNARY
    for name, ref in INT_REF.items():
        got = K.unary(name, ti, 3.0 if name != "clamp" else -2.0, 4.0)
        assert got.dtype is ti.dtype, name
        np.testing.assert_array_equal(got.numpy(), ref(xi), err_msg=name)
    for name, ref in (("eq", np.equal), ("lt", np.less), ("ge", np.greater_equal)):
        np.testing.assert_array_equal(K.binary(name, tx, ty).numpy(), ref(x, y), err_msg=name)
