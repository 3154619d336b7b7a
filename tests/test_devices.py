"""Devices as PyTorch spells them: helios.device, x.to("cpu") / x.cpu() / x.to("vulkan:0"), a dtype and a
device in one .to(), cpu tensors (host memory: data, views, casts, copies; no kernels) and the one-line
errors for a device that does not exist."""

import numpy as np
import pytest
import torch

import helios as hl
from helios import nn

DTYPES = [hl.float32, hl.float16, hl.bfloat16, hl.int32, hl.int64, hl.bool]
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
         "int64": torch.int64, "bool": torch.bool}


def _sample(d, shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    if d.kind == "float":
        return hl.tensor(rng.standard_normal(shape).astype(np.float32) * 3, dtype=d)
    if d.kind == "bool":
        return hl.tensor(rng.random(shape) > 0.5)
    return hl.tensor(rng.integers(-1000, 1000, shape), dtype=d)


# -- helios.device --------------------------------------------------------------------------------
def test_device_objects_spell_like_torch():
    d = hl.device("vulkan:0")
    assert (d.type, d.index, str(d), repr(d)) == ("vulkan", 0, "vulkan:0", "device(type='vulkan', index=0)")
    assert hl.device("vulkan", 0) == d == "vulkan:0" and hl.device(0) == d and hl.device(d) is d
    c = hl.device("cpu")
    assert (c.type, c.index, repr(c)) == ("cpu", None, "device(type='cpu')") and c == "cpu" == hl.device("cpu:0")
    assert repr(torch.device("cpu")) == repr(c) and repr(torch.device("cuda", 0)).replace("cuda", "vulkan") == repr(d)
    assert hl.device("vulkan").index is None and hl.device("vulkan").type == "vulkan"
    assert {d: 1}["vulkan:0"] == 1  # hashes as its name


@pytest.mark.parametrize("bad", ["cuda:x", "gpu", "vulkan:x", "cpu:1", "", "tpu:3"])
def test_a_wrong_device_name_is_one_line_naming_it_and_the_devices(bad):
    with pytest.raises(hl.DeviceError) as ei:
        hl.device(bad)
    msg = str(ei.value)
    assert "\n" not in msg and repr(bad) in msg and "cpu" in msg and "vulkan" in msg


@pytest.mark.vulkan
@pytest.mark.parametrize("spec", ["cuda:9", "vulkan:9", "gpu", "mps"])
def test_to_a_device_that_does_not_exist(spec):
    x = hl.ones(3)
    for call in (lambda: x.to(spec), lambda: x.to(device=spec), lambda: x.to(spec, hl.float16)):
        with pytest.raises(hl.DeviceError) as ei:
            call()
        msg = str(ei.value)
        assert "\n" not in msg and spec in msg and "cpu" in msg and "vulkan:0" in msg, msg
        assert "dtype 'cpu'" not in msg
    with pytest.raises(hl.DeviceError, match="cpu.*Vulkan device"):
        hl.set_device("cpu")


# -- moving and casting ---------------------------------------------------------------------------
@pytest.mark.vulkan
@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
def test_cpu_round_trip_is_bit_exact(d):
    x = _sample(d)
    c = x.to("cpu")
    assert c.device == "cpu" and c.device.type == "cpu" and c.is_cpu and not x.is_cpu and c.dtype is d
    np.testing.assert_array_equal(c.numpy(), x.numpy())
    back = c.to("vulkan:0")
    assert back.device == "vulkan:0" and back.dtype is d
    np.testing.assert_array_equal(back.numpy(), x.numpy())
    assert c.cpu() is c and x.to("vulkan:0") is x and x.to(hl.device("vulkan", 0)) is x
    assert x.cpu().device == "cpu" and x.to(device="cpu").device == "cpu"
    assert "device='cpu'" in repr(c)


@pytest.mark.vulkan
@pytest.mark.parametrize("src", [hl.float32, hl.bfloat16, hl.int64, hl.bool], ids=lambda d: d.name)
@pytest.mark.parametrize("dst", [hl.float32, hl.float16, hl.bfloat16, hl.int32, hl.bool], ids=lambda d: d.name)
def test_dtype_and_device_in_one_to_call(src, dst):
    x = _sample(src, seed=3)
    want = torch.tensor(x.numpy()).to(TORCH[src.name]).to("cpu", TORCH[dst.name])
    want = want.float().numpy() if dst is hl.bfloat16 else want.numpy()
    forms = [x.to("cpu", dst), x.to(dtype=dst, device="cpu"), x.to(device=hl.device("cpu"), dtype=dst),
             x.to("cpu").to(dst), x.to(dst).to("cpu")]
    for y in forms:
        assert y.device == "cpu" and y.dtype is dst
        np.testing.assert_array_equal(y.numpy(), want)
    z = x.to("cpu").to("vulkan:0", dst)  # and from cpu to the device
    assert z.device == "vulkan:0" and z.dtype is dst
    np.testing.assert_array_equal(z.numpy(), want)


@pytest.mark.vulkan
def test_to_other_tensor_and_copy_flag():
    x = _sample(hl.float32)
    other = hl.zeros(1, dtype=hl.float16).cpu()
    y = x.to(other)
    assert y.device == "cpu" and y.dtype is hl.float16
    np.testing.assert_array_equal(y.numpy(), x.numpy().astype(np.float16))
    c = x.cpu()
    assert c.to("cpu", copy=True) is not c and c.to("cpu", False, True) is not c
    np.testing.assert_array_equal(c.to("cpu", copy=True).numpy(), c.numpy())


@pytest.mark.vulkan
def test_cpu_tensors_hold_data_views_and_copies():
    a = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    c = hl.tensor(a, device="cpu")
    assert c.device == "cpu"
    np.testing.assert_array_equal(c.T.numpy(), a.T)
    np.testing.assert_array_equal(c[1:, ::2].numpy(), a[1:, ::2])
    np.testing.assert_array_equal(c.reshape(3, 8).numpy(), a.reshape(3, 8))
    np.testing.assert_array_equal(c.T.contiguous().numpy(), a.T)
    np.testing.assert_array_equal(c.T.to("vulkan:0").numpy(), a.T)  # a strided view moves too
    assert c[2, 3].item() == a[2, 3] and c.tolist() == a.tolist()
    assert hl.zeros(2, 3, device="cpu").numpy().sum() == 0 and hl.full((2,), 7, device="cpu").tolist() == [7, 7]
    cl = c.clone()
    cl.zero_()
    assert cl.numpy().sum() == 0 and np.array_equal(c.numpy(), a)  # a clone is its own storage
    # copy_ between devices, both ways, into contiguous and strided destinations
    dev = hl.zeros(6, 4)
    dev.copy_(c.T)
    np.testing.assert_array_equal(dev.numpy(), a.T)
    dev_t = hl.zeros(6, 4).T
    dev_t.copy_(c)
    np.testing.assert_array_equal(dev_t.numpy(), a)
    host = hl.zeros(4, 6, dtype=hl.bfloat16, device="cpu")
    host.copy_(hl.tensor(a))
    np.testing.assert_array_equal(host.numpy(), hl.tensor(a).to(hl.bfloat16).numpy())
    host[0].copy_(hl.tensor(np.arange(6, dtype=np.float32)))  # broadcast into a view
    assert host.numpy()[0].tolist() == list(range(6))


@pytest.mark.vulkan
def test_ops_on_cpu_tensors_say_to_move_them():
    c = hl.ones(3).cpu()
    for op in (lambda: c + 1, lambda: c.exp(), lambda: c.sum(), lambda: hl.randn(3, device="cpu")):
        with pytest.raises(hl.DeviceError) as ei:
            op()
        msg = str(ei.value)
        assert "cpu" in msg and ".to('vulkan:0')" in msg and "\n" not in msg
    with pytest.raises((hl.DeviceError, hl.ShapeError), match="cpu"):
        c + hl.ones(3)


@pytest.mark.vulkan
def test_gradients_flow_through_device_moves():
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    xh = hl.tensor(a, requires_grad=True)
    xt = torch.tensor(a, requires_grad=True)
    yh = (xh * 3).to("cpu").to("vulkan:0", hl.float16).float().exp().sum()
    yt = (xt * 3).to("cpu").to(torch.float16).float().exp().sum()
    yh.backward()
    yt.backward()
    np.testing.assert_allclose(xh.grad.numpy(), xt.grad.numpy(), rtol=2e-3)


@pytest.mark.vulkan
def test_state_dict_on_cpu_loads_into_a_model():
    src = nn.Sequential(nn.Linear(4, 5, seed=1), nn.Tanh(), nn.LayerNorm(5))
    dst = nn.Sequential(nn.Linear(4, 5, seed=2), nn.Tanh(), nn.LayerNorm(5))
    sd = {k: v.cpu() for k, v in src.state_dict().items()}
    assert all(v.device == "cpu" for v in sd.values())
    dst.load_state_dict(sd)
    x = hl.randn(2, 4, seed=0)
    np.testing.assert_array_equal(dst(x).numpy(), src(x).numpy())
    cpu_model = nn.Linear(3, 2, device="cpu")
    assert cpu_model.weight.device == "cpu" and cpu_model.bias.device == "cpu"
