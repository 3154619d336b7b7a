"""Hugging Face model folders in and out: ``config.json`` with ``model.safetensors``, or with a
sharded ``model.safetensors.index.json`` and its shards.

The tensors go through the ``safetensors`` package (its numpy API; bfloat16, which numpy
lacks, through its raw ``deserialize`` / ``serialize_file`` with the bits in uint16), never
torch.  Offline only: a path, never a hub name.  Files are written to a temporary name in
the folder, fsynced and renamed (config.json last), so a crash leaves no torn file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import numpy as np

from helios import dtypes as dt
from helios.errors import CheckpointError
from helios.fileio import atomic_open, fsync_dir

__all__ = ["from_pretrained", "save_folder", "read_safetensors", "SUPPORTED_TYPES"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SUPPORTED_TYPES = ("gpt2", "llama", "mistral", "qwen2")
_NP_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _dtype_arg(dtype):
    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        return dt.as_dtype({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype))
    return dt.as_dtype(dtype)


def read_safetensors(path) -> dict[str, np.ndarray]:
    """The tensors of one .safetensors file as numpy arrays: F32, F16 and F64 as they are,
    BF16 widened exactly to float32 (the value is what counts; a bfloat16 model gets the same
    bits back).  Another dtype is a CheckpointError naming the tensor."""
    from safetensors import deserialize, safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="np") as f:
            kinds = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            if all(v in _NP_TYPES for v in kinds.values()):
                return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # the package's own error types vary by version
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    bad = [f"{k} ({v})" for k, v in kinds.items() if v not in _NP_TYPES and v != "BF16"]
    if bad:
        raise CheckpointError(f"{path}: tensors of a dtype Helios does not load: {', '.join(bad[:5])}; "
                              "F32, F16, BF16 and F64 are read")
    with open(path, "rb") as fh:
        raw = fh.read()
    out = {}
    for name, info in deserialize(raw):
        if info["dtype"] == "BF16":
            bits = np.frombuffer(info["data"], dtype="<u2").astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(info["shape"])
        else:
            out[name] = np.frombuffer(info["data"], dtype=_NP_TYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def _weight_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{folder / INDEX}: not a safetensors index (a JSON object with a "
                                  f"weight_map of tensor name -> file): {e}") from e
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{folder / INDEX} names shards that are not in the folder: {', '.join(missing[:5])}")
        return [folder / f for f in files]
    if any((folder / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise CheckpointError(f"{folder} holds pytorch_model.bin weights; Helios reads safetensors only: convert them "
                              "once with transformers (AutoModelForCausalLM.from_pretrained(DIR)"
                              ".save_pretrained(DIR, safe_serialization=True))")
    raise CheckpointError(f"{folder} has no {WEIGHTS} and no {INDEX}")


def from_pretrained(path, dtype=None, device=None):
    """The model of a Hugging Face folder: ``config.json`` and ``model.safetensors`` (or a
    sharded ``model.safetensors.index.json``), for ``model_type`` gpt2 (a
    :class:`~helios.models.GPT2LMHeadModel`) and llama (a :class:`~helios.models.LlamaForCausalLM`;
    mistral and qwen2 configs load there where their fields match).

    ``dtype``: the weights' dtype (helios.float32 by default; "auto" keeps the checkpoint's
    ``torch_dtype``); ``device``: where they go (the current device by default).  The model is
    returned in eval mode.  Offline only: ``path`` must be a folder on this machine."""
    from helios.models.gpt2 import GPT2Config, GPT2LMHeadModel
    from helios.models.llama import LLAMA_TYPES, LlamaConfig, LlamaForCausalLM

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: path must be a folder path (str or PathLike), got {type(path).__name__}")
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"from_pretrained: {str(path)!r} is not a folder on this machine; Helios loads offline "
                              f"only: download the model first (e.g. `huggingface-cli download {path} --local-dir DIR`) "
                              "and pass that folder")
    if not folder.is_dir():
        raise CheckpointError(f"from_pretrained: {folder} is a file; pass the model's folder (config.json and "
                              f"{WEIGHTS})")
    if not (folder / CONFIG).is_file():
        raise CheckpointError(f"from_pretrained: {folder} has no {CONFIG}; a Hugging Face model folder holds "
                              f"{CONFIG} and {WEIGHTS}")
    try:
        cfg = json.loads((folder / CONFIG).read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"from_pretrained: {folder / CONFIG} is not a JSON object ({e})") from e
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(f"from_pretrained: model_type {model_type!r} ({folder / CONFIG}) is not supported; "
                              "Helios loads gpt2 and llama (and mistral / qwen2 configs of llama's shape)")
    files = _weight_files(folder)
    want = _dtype_arg(dtype)
    if want == "auto":
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        want = dt.as_dtype(name) if name in ("float32", "float16", "bfloat16") else dt.float32
    try:
        if model_type == "gpt2":
            config = GPT2Config.from_hf(cfg)
            model = GPT2LMHeadModel(config, device=device, dtype=want)
        else:
            assert model_type in LLAMA_TYPES
            config = LlamaConfig.from_hf(cfg)
            model = LlamaForCausalLM(config, device=device, dtype=want)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"from_pretrained: {folder / CONFIG}: {e}") from e
    state: dict[str, np.ndarray] = {}
    for f in files:
        state.update(read_safetensors(f))
    if model_type != "gpt2":
        prefixed = any(k.startswith("model.") for k in state)
        state = {(k if prefixed or k.startswith("lm_head.") else "model." + k): v for k, v in state.items()
                 if not k.endswith("rotary_emb.inv_freq")}
    try:
        model.load_hf_state_dict(state)
    except CheckpointError as e:
        raise CheckpointError(f"from_pretrained: the weights in {folder} do not match its {CONFIG}: {e}") from e
    return model.eval()


# -- writing ---------------------------------------------------------------------------------------
def _parse_size(size) -> int | None:
    if size is None:
        return None
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is not a byte count like 5000000, '500MB' or '5GB'")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * mult)


def _host_array(t) -> tuple[np.ndarray, str]:
    """(bytes-ready array, safetensors dtype name) of a tensor in its own dtype."""
    arr = np.ascontiguousarray(t.numpy())
    if t.dtype is dt.bfloat16:
        return np.ascontiguousarray(dt.float32_to_bf16_bits(arr.astype(np.float32))), "bfloat16"
    if t.dtype is dt.float16:
        return arr.astype(np.float16), "float16"
    if t.dtype is dt.float32:
        return arr.astype(np.float32), "float32"
    raise CheckpointError(f"save_pretrained: a {t.dtype.name} weight cannot be saved (float32, float16, bfloat16)")


def _write_safetensors(target: Path, arrays: dict) -> None:
    """arrays: name -> (array, dtype name); written to a temp name, fsynced, renamed."""
    from safetensors import TensorSpec, serialize_file

    specs = {k: TensorSpec(dtype=name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
             for k, (a, name) in arrays.items()}
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        serialize_file(specs, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # the serializer creates 0600; the folder's other files are 0644
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_folder(model, path, max_shard_size=None) -> None:
    """``model.save_pretrained(path)``: see GPT2LMHeadModel.save_pretrained."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"save_pretrained: {folder} is a file; give a folder")
    limit = _parse_size(max_shard_size)
    state = model.hf_state_dict()
    arrays = {k: _host_array(t) for k, t in state.items()}
    dtypes = {t.dtype.name for t in state.values()}
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(a.nbytes for a, _ in arrays.values())
    shards: list[dict] = [arrays]
    if limit is not None and total > limit:
        shards, size = [{}], 0
        for k, v in arrays.items():
            if shards[-1] and size + v[0].nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v[0].nbytes
    written = []
    if len(shards) == 1:
        _write_safetensors(folder / WEIGHTS, shards[0])
        written.append(WEIGHTS)
    else:
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            _write_safetensors(folder / name, shard)
            written.append(name)
            weight_map.update({k: name for k in shard})
        with atomic_open(folder / INDEX, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX)
    # what an earlier save left that the loader could take instead of these files
    for old in folder.iterdir():
        if old.name not in written and (old.name in (WEIGHTS, INDEX) or _SHARD.match(old.name)):
            old.unlink()
    cfg = model.config.to_hf()
    name = dtypes.pop() if len(dtypes) == 1 else "float32"
    cfg["torch_dtype"] = name
    cfg["dtype"] = name
    with atomic_open(folder / CONFIG, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    fsync_dir(folder)
