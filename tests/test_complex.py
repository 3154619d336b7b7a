"""Complex tensors (helios.complex): torchtitan's rotary embedding, written once and run with
``L`` = helios and ``L`` = torch, gives PyTorch's outputs and gradients; each complex operation
matches PyTorch CPU forward and backward; and everything else is refused with one error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import helios as hl
from helios.complex import ComplexTensor, ComplexUnsupportedError
from parity import assert_close, check

pytestmark = pytest.mark.vulkan

RNG = np.random.default_rng(7)


def A(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- torchtitan's llama rotary embedding (torchtitan/models/llama/model.py), torch. -> L. ----------
def precompute_freqs_cis(L, dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (L.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = L.arange(end, device=freqs.device)
    freqs = L.outer(t, freqs).float()
    freqs_cis = L.polar(L.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(L, xq, xk, freqs_cis):
    xq_ = L.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = L.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = L.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = L.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


B, T, HEADS, HEAD_DIM = 2, 8, 4, 16


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_torchtitan_rotary_embedding_matches_pytorch(kv_heads):
    """Forward outputs, the frequencies, and the gradients of xq and xk agree to 1e-5; the
    frequencies are precomputed for 2T positions and sliced to T, as torchtitan does."""
    q, k = A(B, T, HEADS, HEAD_DIM), A(B, T, kv_heads, HEAD_DIM)
    gq, gk = A(B, T, HEADS, HEAD_DIM), A(B, T, kv_heads, HEAD_DIM)
    res = {}
    for L in (hl, torch):
        xq, xk = L.tensor(q, requires_grad=True), L.tensor(k, requires_grad=True)
        freqs_cis = precompute_freqs_cis(L, HEAD_DIM, 2 * T)
        assert freqs_cis.dtype is L.complex64 and tuple(freqs_cis.shape) == (2 * T, HEAD_DIM // 2)
        oq, ok = apply_rotary_emb(L, xq, xk, freqs_cis)
        ((oq * L.tensor(gq)).sum() + (ok * L.tensor(gk)).sum()).backward()
        res[L] = (freqs_cis, oq, ok, xq.grad, xk.grad)
    hf, tf = res[hl][0].numpy(), res[torch][0].numpy()
    assert hf.dtype == np.complex64
    np.testing.assert_allclose(hf, tf, rtol=1e-5, atol=1e-5, err_msg="freqs_cis")
    for what, h, t in zip(("xq_out", "xk_out", "grad of xq", "grad of xk"), res[hl][1:], res[torch][1:]):
        assert_close(h, t, "float32", what)
    # a rotation keeps each pair's length: the outputs are not trivially equal to the inputs
    assert not np.allclose(res[hl][1].numpy(), q, atol=1e-3)
    np.testing.assert_allclose(np.linalg.norm(res[hl][1].numpy().reshape(-1, 2), axis=1),
                               np.linalg.norm(q.reshape(-1, 2), axis=1), rtol=1e-5)


def test_torchtitan_rotary_embedding_bfloat16_inputs():
    """Mixed precision: bfloat16 xq/xk are rotated in float32 and cast back by type_as."""
    q, k = A(B, T, HEADS, HEAD_DIM), A(B, T, HEADS, HEAD_DIM)
    res = {}
    for L in (hl, torch):
        xq = L.tensor(q).to(L.bfloat16).requires_grad_()
        xk = L.tensor(k).to(L.bfloat16).requires_grad_()
        oq, ok = apply_rotary_emb(L, xq, xk, precompute_freqs_cis(L, HEAD_DIM, T))
        assert oq.dtype is L.bfloat16 and ok.dtype is L.bfloat16
        (oq.float().sum() * 2 + (ok.float() * ok.float()).sum()).backward()
        res[L] = (oq, ok, xq.grad, xk.grad)
    for what, h, t in zip(("xq_out", "xk_out", "grad of xq", "grad of xk"), res[hl], res[torch]):
        assert_close(h, t, "bfloat16", what)


# -- each operation against PyTorch (forward and backward through the real inputs) ----------------
def C(L, x):
    return L.view_as_complex(x)


def R(L, z):
    return L.view_as_real(z)


OPS = {
    "mul complex broadcast": (lambda L, x, y: R(L, C(L, x) * C(L, y)), (A(2, 3, 2), A(3, 2))),
    "mul real tensor": (lambda L, x, y: R(L, C(L, x) * y), (A(2, 3, 2), A(4, 2, 3))),
    "mul numbers": (lambda L, x: R(L, 2.5 * C(L, x) * 3 * (0.5 - 2j) * np.float32(1.5)), (A(3, 2),)),
    "add and sub complex": (lambda L, x, y: R(L, C(L, x) + C(L, y) - C(L, y) * C(L, x)), (A(2, 3, 2), A(2, 1, 2))),
    "add and sub real tensor": (lambda L, x, y: R(L, (C(L, x) + y) - y * 3), (A(3, 2), A(2, 3))),
    "add and sub numbers": (lambda L, x: R(L, 1.5 - (C(L, x) + 2) - 1j + (3 + 0.5j) - C(L, x) - 4), (A(3, 2),)),
    "neg": (lambda L, x: R(L, -C(L, x)), (A(3, 2),)),
    "conj": (lambda L, x, y: R(L, C(L, x).conj() * C(L, y)), (A(4, 2), A(4, 2))),
    "real and imag": (lambda L, x: C(L, x).real * 3 - C(L, x).imag * C(L, x).real, (A(2, 3, 2),)),
    "abs, zero included": (lambda L, x: C(L, x).abs(), (np.concatenate([A(5, 2), np.zeros((1, 2), np.float32)]),)),
    "angle, zero included": (lambda L, x: C(L, x).angle(),
                             (np.array([[1, 2], [-1, 2], [-1, -2], [1, -2], [0, 0], [-3, 0], [0, 1]], np.float32),)),
    "polar of abs and angle": (lambda L, x: R(L, L.polar(C(L, x).abs(), C(L, x).angle())), (A(4, 2) + 3,)),
    "index and slice": (lambda L, x: R(L, C(L, x)[1, ::2, None, ..., -1:] * C(L, x)[0:1, 1:3]), (A(2, 4, 3, 2),)),
    "view, reshape, unsqueeze": (lambda L, x: R(L, C(L, x).view(3, 4).reshape(2, 2, 3).unsqueeze(1) * 2), (A(4, 3, 2),)),
    "view of a slice": (lambda L, x: R(L, C(L, x)[1:3].view(1, 2, 1, 5)), (A(4, 5, 2),)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_operation_matches_pytorch(name):
    fn, arrays = OPS[name]
    check(fn, *arrays)


def test_metadata_and_numpy():
    x = A(2, 3, 2)
    z, t = hl.view_as_complex(hl.tensor(x)), torch.view_as_complex(torch.tensor(x))
    assert z.shape == (2, 3) and z.ndim == 2 and z.dtype is hl.complex64 and repr(z.dtype) == "helios.complex64"
    assert str(z.dtype).split(".")[-1] == str(t.dtype).split(".")[-1] == "complex64"
    a = z.numpy()
    assert a.dtype == np.complex64 and a.shape == (2, 3)
    np.testing.assert_array_equal(a, t.numpy())
    np.testing.assert_array_equal(z.real.numpy(), x[..., 0])
    np.testing.assert_array_equal(z.imag.numpy(), x[..., 1])
    assert "complex64" in repr(z) and "j" in repr(z)
    assert z.device == hl.tensor(x).device
    r = hl.view_as_real(z)
    assert r.dtype is hl.float32 and r.shape == (2, 3, 2)
    np.testing.assert_array_equal(r.numpy(), x)


def test_real_and_imag_are_views_of_the_input():
    """As in PyTorch, the parts of view_as_complex(x) share x's memory."""
    x = hl.tensor(A(3, 2))
    z = hl.view_as_complex(x)
    x.zero_()
    np.testing.assert_array_equal(z.numpy(), np.zeros(3, np.complex64))


def test_to_device_and_dtype():
    z = hl.polar(hl.tensor(A(2, 3)), hl.tensor(A(2, 3)))
    h = z.to("cpu")
    assert h.device == "cpu" and isinstance(h, ComplexTensor)
    np.testing.assert_array_equal(h.numpy(), z.numpy())
    back = h.to(device=z.device)
    assert back.device == z.device
    np.testing.assert_array_equal(back.numpy(), z.numpy())
    assert z.to(hl.complex64) is z and z.to(z.device) is z and z.to(h).device == "cpu"
    with pytest.raises(hl.DTypeError, match="cannot be cast to helios.float32"):
        z.to(hl.float32)


def test_input_errors():
    with pytest.raises(hl.ShapeError, match="last dimension of size 2"):
        hl.view_as_complex(hl.zeros(4, 3))
    with pytest.raises(hl.ShapeError, match="one or more dimensions"):
        hl.view_as_complex(hl.tensor(1.0))
    with pytest.raises(hl.DTypeError, match="float32"):
        hl.view_as_complex(hl.zeros(4, 2, dtype=hl.int64))
    with pytest.raises(hl.ShapeError, match="stride 1"):  # PyTorch refuses it too
        hl.view_as_complex(hl.zeros(2, 4).t())
    with pytest.raises(RuntimeError, match="stride 1"):
        torch.view_as_complex(torch.zeros(2, 4).t())
    with pytest.raises(TypeError, match="only supported for complex tensors"):
        hl.view_as_real(hl.zeros(3, 2))
    with pytest.raises(hl.DTypeError, match="float32"):
        hl.polar(hl.ones(3, dtype=hl.int64), hl.zeros(3, dtype=hl.int64))
    with pytest.raises(TypeError, match="abs must be a helios.Tensor"):
        hl.polar(1.0, hl.zeros(3))
    z = hl.view_as_complex(hl.tensor(A(3, 2)))
    with pytest.raises(hl.ShapeError):
        z * hl.view_as_complex(hl.tensor(A(4, 2)))
    with pytest.raises(TypeError):
        z * "2"
    with pytest.raises(hl.DTypeError):  # complex64 is a marker, not a dtype kernels take
        hl.zeros(2, dtype=hl.complex64)


@pytest.mark.parametrize("op", [
    lambda z: z.sum(), lambda z: z.matmul(z), lambda z: z @ z, lambda z: z / 2, lambda z: z ** 2,
    lambda z: z == z, lambda z: bool(z), lambda z: len(z), lambda z: list(z), lambda z: z.mean(), lambda z: z.exp(),
    lambda z: z.__setitem__(0, 1.0), lambda z: np.asarray(z), lambda z: z.backward(),
], ids=["sum", "matmul", "@", "/", "**", "==", "bool", "len", "iter", "mean", "exp", "setitem", "asarray", "backward"])
def test_other_operations_raise_one_clear_error(op):
    z = hl.view_as_complex(hl.tensor(A(2, 3, 2)))
    with pytest.raises(ComplexUnsupportedError, match="support only the rotary-embedding operations") as e:
        op(z)
    assert "\n" not in str(e.value) and "view_as_real" in str(e.value)
    assert isinstance(e.value, hl.HeliosError) and isinstance(e.value, TypeError)


def test_missing_names_stay_attribute_errors():
    """hasattr and getattr with a default keep working for what a complex tensor lacks."""
    z = hl.view_as_complex(hl.tensor(A(2, 2)))
    assert not hasattr(z, "sum") and getattr(z, "matmul", None) is None
    assert hasattr(z, "conj") and hasattr(z, "real")


def test_a_real_tensor_on_the_left_hands_over_to_the_complex_one():
    x_np = np.array([1.0, -2.0, 0.5], np.float32)
    ang = np.array([0.3, 1.1, -2.0], np.float32)
    z, tz = hl.polar(hl.ones(3), hl.tensor(ang)), torch.polar(torch.ones(3), torch.tensor(ang))
    x, tx = hl.tensor(x_np), torch.tensor(x_np)
    for got, want in ((x * z, tx * tz), (x + z, tx + tz), (x - z, tx - tz)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
