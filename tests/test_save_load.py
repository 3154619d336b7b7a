"""helios.save / helios.load: tensors (bfloat16 bit-exact), state dicts and nested containers in the
project's checkpoint container (atomic, hashed), map_location, and no code run on load."""

import math
import os
import pickle
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

import helios as hl
from helios import nn
from helios.fileio import load_checkpoint, save_checkpoint
from helios.runtime import cuda_status

DEV = os.environ.get("HELIOS_DEVICE", "vulkan:0")  # the device the suite runs on
DTYPES = [hl.float32, hl.float16, hl.bfloat16, hl.int32, hl.int64, hl.bool]


def _sample(d, shape, seed=0):
    rng = np.random.default_rng(seed)
    if d.kind == "float":
        return hl.tensor(rng.standard_normal(shape).astype(np.float32), dtype=d)
    if d.kind == "bool":
        return hl.tensor(rng.random(shape) > 0.5)
    return hl.tensor(rng.integers(-(2 ** 31), 2 ** 31 - 1, shape), dtype=d)


@pytest.mark.vulkan
@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (2, 0, 3)], ids=str)
def test_tensor_round_trip_bit_exact(tmp_path, d, shape):
    x = _sample(d, shape)
    hl.save(x, tmp_path / "t.hl")
    y = hl.load(tmp_path / "t.hl")
    assert isinstance(y, hl.Tensor) and y.dtype is d and y.shape == x.shape and y.device == DEV
    np.testing.assert_array_equal(y.numpy(), x.numpy())
    c = hl.load(str(tmp_path / "t.hl"), map_location="cpu")
    assert c.device == "cpu" and c.dtype is d
    np.testing.assert_array_equal(c.numpy(), x.numpy())


@pytest.mark.vulkan
def test_bfloat16_keeps_every_bit(tmp_path):
    # every bf16 bit pattern but NaNs (whose payloads numpy may canonicalise on the float32 round trip)
    bits = np.arange(1 << 16, dtype=np.uint32)
    vals = (bits << 16).view(np.float32)
    vals = vals[~np.isnan(vals)]
    x = hl.tensor(vals, dtype=hl.bfloat16)
    hl.save({"w": x, "w_cpu": x.cpu()}, tmp_path / "bf.hl")
    back = hl.load(tmp_path / "bf.hl")
    for k in ("w", "w_cpu"):
        np.testing.assert_array_equal(back[k].numpy().view(np.uint32), vals.view(np.uint32))
    assert back["w_cpu"].device == "cpu" and back["w"].device == DEV
    arrays, meta, logical = load_checkpoint(tmp_path / "bf.hl", return_dtypes=True)
    assert set(logical.values()) == {"bfloat16"}  # the container's own logical dtype, not a second format
    assert meta["format"] == "helios.save"


@pytest.mark.vulkan
def test_state_dict_round_trip_into_a_fresh_model(tmp_path):
    cfg = nn.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    a, b = nn.GPT(cfg, seed=1), nn.GPT(cfg, seed=2)
    hl.save(a.state_dict(), tmp_path / "sd.hl")
    sd = hl.load(tmp_path / "sd.hl")
    assert isinstance(sd, OrderedDict) and list(sd) == list(a.state_dict())
    b.load_state_dict(sd)
    idx = np.random.default_rng(0).integers(0, 32, (2, 8))
    np.testing.assert_array_equal(b(idx)[0].numpy(), a(idx)[0].numpy())
    b.load_state_dict(hl.load(tmp_path / "sd.hl", map_location="cpu"))  # cpu tensors load too
    np.testing.assert_array_equal(b(idx)[0].numpy(), a(idx)[0].numpy())


@pytest.mark.vulkan
def test_state_dict_keys_and_values_agree_with_torch(tmp_path):
    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.RMSNorm(4))
    h = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.RMSNorm(4))
    h.load_state_dict({k: v.detach().numpy() for k, v in t.state_dict().items()})
    hl.save(h.state_dict(), tmp_path / "m.hl")
    loaded = hl.load(tmp_path / "m.hl")
    t2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.RMSNorm(4))
    t2.load_state_dict({k: torch.tensor(v.numpy()) for k, v in loaded.items()})
    for (k1, v1), (k2, v2) in zip(t.state_dict().items(), t2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


@pytest.mark.vulkan
def test_nested_containers_keep_their_types(tmp_path):
    w = hl.randn(2, 3, seed=0, requires_grad=True)
    p = nn.Parameter(hl.ones(2))
    Point = namedtuple("Point", "x y")
    obj = {
        "step": 7, "lr": 3e-4, "name": "run", "none": None, "flag": False, "big": 2 ** 70,
        "inf": math.inf, "nan": math.nan, "list": [1, (2, "three"), [None]], "tuple": (w, p),
        "odict": OrderedDict([("b", 1), ("a", 2)]), "np": np.arange(6, dtype=np.float64).reshape(2, 3),
        "complex": np.array([1 + 2j]), "npscalar": np.float16(1.5), "i64": np.int64(-3), "bytes": b"\x00\xff",
        "dtype": hl.bfloat16, "device": hl.device(DEV), 3: "int key", (1, "a"): "tuple key", None: "none key",
        "point": Point(1, 2), "same": [w, w], "empty": {}, "empty_list": [], "empty_tuple": (),
    }
    hl.save(obj, tmp_path / "o.hl")
    back = hl.load(tmp_path / "o.hl")
    assert list(back) == list(obj)
    for k in ("step", "lr", "name", "none", "flag", "big", "inf", "list", "odict", "bytes", "empty", "empty_list",
              "empty_tuple", 3, (1, "a"), None):
        assert back[k] == obj[k] and type(back[k]) is type(obj[k]), k
    assert math.isnan(back["nan"]) and back["point"] == (1, 2) and type(back["point"]) is tuple
    assert type(back["odict"]) is OrderedDict and list(back["odict"]) == ["b", "a"]
    np.testing.assert_array_equal(back["np"], obj["np"])
    assert back["np"].dtype == np.float64 and back["complex"].dtype == np.complex128
    assert back["npscalar"] == np.float16(1.5) and back["npscalar"].dtype == np.float16 and back["i64"].dtype == np.int64
    assert back["dtype"] is hl.bfloat16 and back["device"] == DEV and isinstance(back["device"], hl.device)
    bw, bp = back["tuple"]
    assert bw.requires_grad and bw.is_leaf and isinstance(bp, nn.Parameter) and bp.requires_grad
    np.testing.assert_array_equal(bw.numpy(), w.numpy())
    assert back["same"][0] is back["same"][1] is bw  # one tensor, stored once
    assert len(load_checkpoint(tmp_path / "o.hl")[0]) == 7  # w (reached 3 times), p, np, complex, npscalar, i64, bytes


@pytest.mark.vulkan
def test_map_location_forms(tmp_path):
    x = hl.arange(6, dtype=hl.int64)
    hl.save({"dev": x, "host": x.cpu()}, tmp_path / "m.hl")
    for loc in ("cpu", hl.device("cpu"), torch.device("cpu"), lambda t, saved: t):
        got = hl.load(tmp_path / "m.hl", map_location=loc)
        assert got["dev"].device == "cpu" and got["host"].device == "cpu"
    got = hl.load(tmp_path / "m.hl", map_location=DEV)
    assert got["dev"].device == DEV and got["host"].device == DEV
    got = hl.load(tmp_path / "m.hl", map_location={DEV: "cpu"})
    assert got["dev"].device == "cpu" and got["host"].device == "cpu"
    got = hl.load(tmp_path / "m.hl", map_location={"cpu": DEV}, weights_only=True)
    assert got["dev"].device == DEV and got["host"].device == DEV
    seen = []
    hl.load(tmp_path / "m.hl", map_location=lambda t, saved: seen.append(saved) or t.to(DEV))
    assert sorted(seen) == ["cpu", DEV]
    if not cuda_status()[0]:  # a device that does not exist here is refused, naming what does
        with pytest.raises(hl.DeviceError, match="cuda:0.*cpu"):
            hl.load(tmp_path / "m.hl", map_location="cuda:0")
    with pytest.raises(hl.DeviceError, match="map_location"):
        hl.load(tmp_path / "m.hl", map_location={DEV: "vulkan:7"})


@pytest.mark.vulkan
def test_unsupported_objects_are_refused_by_path_and_leave_the_file(tmp_path):
    target = tmp_path / "keep.hl"
    hl.save({"a": 1}, target)
    before = target.read_bytes()
    for bad, where in (({"model": nn.Linear(2, 2)}, "obj['model']"), ([1, {"f": print}], "obj[1]['f']"),
                       ({"s": {1, 2}}, "obj['s']"), ({object(): 1}, "key")):
        with pytest.raises(TypeError, match="helios.save") as ei:
            hl.save(bad, target)
        assert where in str(ei.value), str(ei.value)
    assert "state_dict" in str(pytest.raises(TypeError, hl.save, nn.Linear(2, 2), target).value)
    assert target.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["keep.hl"]  # no temp files left
    with pytest.raises(TypeError, match="file path"):
        hl.save(1, open(os.devnull, "wb"))


@pytest.mark.vulkan
def test_damaged_files_are_checkpoint_errors_naming_the_file(tmp_path):
    path = tmp_path / "w.hl"
    hl.save({"w": hl.randn(64, 64, seed=0), "step": 3}, path)
    good = path.read_bytes()
    cases = {
        "flipped": good[:-100] + bytes([good[-100] ^ 0x01]) + good[-99:],
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "foreign": b"just some text, not a checkpoint",
        "index": good[:80] + b"X" + good[81:],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.hl"
        p.write_bytes(data)
        with pytest.raises(hl.CheckpointError) as ei:
            hl.load(p)
        assert str(p) in str(ei.value), (name, str(ei.value))
    with pytest.raises(hl.CheckpointError, match="no such file"):
        hl.load(tmp_path / "missing.hl")
    # a PyTorch file: said so, and nothing is unpickled
    torch.save({"w": torch.ones(2)}, tmp_path / "t.pt")
    with pytest.raises(hl.CheckpointError, match="torch.save"):
        hl.load(tmp_path / "t.pt")
    # a container that helios.save did not write (a training checkpoint)
    save_checkpoint(tmp_path / "train.helios", {"model.w": np.ones(2, np.float32)}, {"step": 1})
    with pytest.raises(hl.CheckpointError, match="not a helios.save file"):
        hl.load(tmp_path / "train.helios")


@pytest.mark.vulkan
def test_load_runs_no_pickle(tmp_path, monkeypatch):
    hl.save({"w": hl.ones(3), "meta": {"k": [1, 2]}}, tmp_path / "x.hl")

    def boom(*a, **k):
        raise AssertionError("helios.load unpickled something")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(np, "load", boom)
    assert hl.load(tmp_path / "x.hl")["meta"] == {"k": [1, 2]}
    assert b"\x80\x04" not in (tmp_path / "x.hl").read_bytes()[:64]  # no pickle protocol header
