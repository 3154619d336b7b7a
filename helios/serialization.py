"""``helios.save`` / ``helios.load``: tensors, state dicts and nested containers in one file.

The file is a Helios checkpoint container (:mod:`helios.fileio`): written to a temporary
name, fsynced and renamed, with a SHA-256 over everything, so a crash never leaves a torn
file and a damaged one is a :class:`~helios.errors.CheckpointError` naming it.  Arrays
(each tensor and numpy array, once) go in the container's array region; the structure
around them is JSON in its metadata.  Loading runs no code from the file: there is no
pickle, only these kinds of values:

- ``helios.Tensor`` (any dtype, bfloat16 bit-exact; its device, ``requires_grad`` and
  whether it was an ``nn.Parameter`` are kept) and numpy arrays (bool, int, uint, float,
  complex);
- ``dict`` (``OrderedDict`` stays one; keys: str, int, float, bool, None or tuples of
  those), ``list``, ``tuple`` (named tuples come back as plain tuples);
- ``int``, ``float`` (inf and nan too), ``bool``, ``str``, ``None``, ``bytes``, numpy
  scalars, ``helios`` dtypes and devices.

The same tensor object reached twice is stored once and loads as one object.  Anything
else (a Module, a function, a dataclass) is a TypeError naming where it is in the object.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any

import numpy as np

from helios import dtypes as dt
from helios.errors import CheckpointError, DeviceError
from helios.fileio import load_checkpoint, save_checkpoint
from helios.runtime import device as _device
from helios.tensor import Tensor

FORMAT = "helios.save"
VERSION = 1


class _Writer:
    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.logical: dict[str, str] = {}
        self.seen: dict[int, str] = {}  # id(tensor or array) -> array name
        self.keep: list = []  # keeps the objects alive while their ids are keys of `seen`

    def array(self, obj, path: str, bits: np.ndarray, logical: str | None) -> str:
        name = f"{len(self.arrays)}:{path}"
        self.arrays[name] = bits
        if logical is not None:
            self.logical[name] = logical
        self.seen[id(obj)] = name
        self.keep.append(obj)
        return name

    def encode(self, obj: Any, path: str) -> Any:
        if isinstance(obj, _device):  # before str: a device is a str
            return {"device": str(obj)}
        if obj is None or isinstance(obj, (bool, str)):
            return str(obj) if isinstance(obj, str) else obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"float": repr(obj)}
        if isinstance(obj, Tensor):
            from helios.device_transfer import raw
            from helios.nn import Parameter

            name = self.seen.get(id(obj))
            if name is None:
                bits = raw(obj)
                name = self.array(obj, path, bits, "bfloat16" if obj.dtype is dt.bfloat16 else None)
            return {"tensor": name, "dtype": obj.dtype.name, "device": str(obj.device),
                    "requires_grad": bool(obj.requires_grad), "parameter": isinstance(obj, Parameter)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(f"helios.save: the numpy array at {path} has dtype {obj.dtype}; only bool, integer, "
                                "float and complex arrays can be saved")
            name = self.seen.get(id(obj)) or self.array(obj, path, obj, None)
            return {"ndarray": name}
        if isinstance(obj, np.generic):
            return {"npscalar": self.encode(np.asarray(obj), path)["ndarray"]}
        if isinstance(obj, (bytes, bytearray)):
            return {"bytes": self.array(obj, path, np.frombuffer(bytes(obj), np.uint8), None)}
        if isinstance(obj, dt.DType):
            return {"dtype": obj.name}
        if isinstance(obj, dict):
            keys, values = [], []
            for k, v in obj.items():
                if not _plain_key(k):
                    raise TypeError(f"helios.save: the dict at {path} has a key of type {type(k).__name__} ({k!r}); "
                                    "keys can be str, int, float, bool, None or tuples of those")
                keys.append(self.encode(k, path))
                values.append(self.encode(v, f"{path}[{k!r}]"))
            return {"odict" if isinstance(obj, OrderedDict) else "dict": [keys, values]}
        if isinstance(obj, (list, tuple)):
            items = [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else {"tuple": items}
        hint = " (save module.state_dict() instead)" if hasattr(obj, "state_dict") else ""
        raise TypeError(f"helios.save: cannot store the {type(obj).__name__} at {path}{hint}: helios.save keeps "
                        "tensors, numpy arrays, numbers, strings, bytes, None, dtypes, devices and dicts, lists "
                        "and tuples of them (no pickle)")


def _plain_key(k) -> bool:
    if isinstance(k, tuple):
        return all(_plain_key(x) for x in k)
    return k is None or isinstance(k, (str, int, float, bool))


def save(obj: Any, f: str | os.PathLike[str]) -> None:
    """Write ``obj`` (a tensor, a state dict, or dicts/lists/tuples of tensors, numpy arrays,
    numbers, strings and None) to the file ``f``, atomically (PyTorch's ``torch.save``).
    bfloat16 is stored as its bits; the file has no pickle (see the module docstring)."""
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"helios.save: the destination must be a file path, got {type(f).__name__}")
    w = _Writer()
    tree = w.encode(obj, "obj")
    save_checkpoint(f, w.arrays, {"format": FORMAT, "version": VERSION, "obj": tree}, dtypes=w.logical)


class _Reader:
    def __init__(self, path: str, arrays: dict, logical: dict, map_location):
        self.path, self.arrays, self.logical, self.map_location = path, arrays, logical, map_location
        self.tensors: dict[str, Tensor] = {}

    def bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path!r}: {what}; the file was not written by helios.save "
                               "or is damaged")

    def target(self, saved: str):
        m = self.map_location
        if m is None:
            return saved
        if isinstance(m, dict):
            return m.get(saved, saved)
        return m

    def tensor(self, node: dict) -> Tensor:
        from helios import device_transfer
        from helios.runtime import HOST, get_runtime

        name = node["tensor"]
        t = self.tensors.get(name)
        if t is not None:
            return t
        if name not in self.arrays:
            raise self.bad(f"tensor {name!r} has no array")
        d = dt.as_dtype(node["dtype"])
        bits = self.arrays[name]
        if bits.dtype != d.np_storage or (d is dt.bfloat16) != (self.logical.get(name) == "bfloat16"):
            raise self.bad(f"tensor {name!r} is stored as {self.logical.get(name)}, its entry says {d.name}")
        saved = node.get("device", "cpu")
        if callable(self.map_location):
            t = self.map_location(device_transfer.from_raw(bits, d, HOST), saved)
            if not isinstance(t, Tensor):
                raise TypeError(f"helios.load: map_location returned a {type(t).__name__}, expected a Tensor")
        else:
            try:
                rt = get_runtime(self.target(saved))
            except DeviceError as e:
                raise DeviceError(f"helios.load({self.path!r}): {e}; choose where the tensors go with "
                                  "map_location='cpu' or 'vulkan:0'") from None
            t = device_transfer.from_raw(bits, d, rt)
        if node.get("parameter"):
            from helios.nn import Parameter

            t = Parameter(t, requires_grad=bool(node.get("requires_grad")))
        elif node.get("requires_grad") and d.is_floating_point:
            t.requires_grad_(True)
        self.tensors[name] = t
        return t

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or len(node) == 0:
            raise self.bad(f"unexpected entry {node!r:.80}")
        if "tensor" in node:
            return self.tensor(node)
        (kind, value), = list(node.items())[:1]
        if kind in ("dict", "odict"):
            keys, values = value
            pairs = [(_hashable(self.decode(k)), self.decode(v)) for k, v in zip(keys, values)]
            return OrderedDict(pairs) if kind == "odict" else dict(pairs)
        if kind == "tuple":
            return tuple(self.decode(v) for v in value)
        if kind in ("ndarray", "npscalar", "bytes"):
            if value not in self.arrays:
                raise self.bad(f"array {value!r} is missing")
            a = self.arrays[value]
            return a if kind == "ndarray" else a.reshape(())[()] if kind == "npscalar" else a.tobytes()
        if kind == "float":
            return float(value)
        if kind == "dtype":
            return dt.as_dtype(value)
        if kind == "device":
            return _device(value)
        raise self.bad(f"unknown entry kind {kind!r}")


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def load(f: str | os.PathLike[str], map_location=None, *, weights_only: bool | None = None, **kwargs) -> Any:
    """Read what :func:`save` wrote (PyTorch's ``torch.load``).

    ``map_location``: None puts each tensor back on the device it was saved from; "cpu",
    "vulkan:N" or a :class:`helios.device` puts every tensor there; a dict maps saved device
    names to others (``{"vulkan:1": "vulkan:0"}``); a callable gets ``(cpu_tensor, saved_device)``
    and returns the tensor to use (``lambda t, loc: t`` keeps everything on cpu).
    ``weights_only`` is accepted for PyTorch code: loading never runs code from the file.
    A missing, truncated or corrupt file, or one ``save`` did not write, is a CheckpointError
    naming the file."""
    if kwargs:
        raise TypeError(f"helios.load() got unexpected keyword arguments {sorted(kwargs)}")
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
    if path is None:
        raise TypeError(f"helios.load: the source must be a file path, got {type(f).__name__}")
    if map_location is not None and not (callable(map_location) or isinstance(map_location, dict)):
        from helios.runtime import parse_device

        parse_device(map_location)  # a bad name fails here, before the file is read
        map_location = str(map_location)
    if os.path.isfile(path):
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise CheckpointError(f"checkpoint {path!r}: a zip archive, as torch.save writes; helios.load reads "
                                      "files written by helios.save (it unpickles nothing): load it with torch.load, "
                                      "convert the tensors with .numpy() and save them with helios.save")
    arrays, meta, logical = load_checkpoint(path, return_dtypes=True)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r}: a Helios container but not a helios.save file (a training "
                              "checkpoint?); read it with helios.fileio.load_checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path!r}: helios.save format version {meta.get('version')}, this Helios "
                              f"reads version {VERSION}; load it with the Helios version that wrote it")
    r = _Reader(path, arrays, logical, map_location)
    try:
        return r.decode(meta.get("obj"))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TypeError) and "map_location" in str(e):
            raise
        raise r.bad(f"its structure cannot be read ({type(e).__name__}: {e})") from e
