"""The training state helios-train checkpoints, as sharded tensors (see schedule/checkpoint.py).

Tensors, named by parameter (so a checkpoint does not depend on how parameters are
grouped or sharded when it is read):

    model.<parameter name>              the parameter
    optim.exp_avg.<parameter name>      AdamW's first moment
    optim.exp_avg_sq.<parameter name>   AdamW's second moment

Replicated state (parameters and moments under plain data parallel) is split evenly over
the ranks for writing, so every rank writes its share in parallel; under ZeRO every rank
writes the ranges it owns (its ``state_dict()``).  Loading asks for the ranges the loading
run needs (everything when replicated, ``shard_ranges()`` under ZeRO), whatever world size
or ZeRO stage wrote them.
"""

from __future__ import annotations

import numpy as np

from helios import random as hrandom
from helios.errors import CheckpointError
from helios.schedule import checkpoint as C

MOMENTS = ("exp_avg", "exp_avg_sq")


def _dtype_name(t) -> str:
    return "bfloat16" if t.dtype.name == "bfloat16" else t.dtype.np_storage.name


_ZERO_KEYS = {"param": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}


def _zero(opt):
    """The ZeroAdamW behind ``opt`` (itself, or a ZeroDataParallel's), or None for a replicated optimizer."""
    from helios.schedule.zero import ZeroAdamW

    inner = getattr(opt, "optimizer", opt)
    return inner if isinstance(inner, ZeroAdamW) else None


def training_shards(gpt, opt, rank: int, world: int, tp_group=None) -> dict[str, C.ShardedArray]:
    """Every tensor of the training state this rank writes (parameters and moments).

    Under tensor parallelism (``tp_group``) each whole tensor is first gathered from the TP
    ranks' shards, so the checkpoint is the same as one device's and loads on any grid."""
    z = _zero(opt)
    if z is None:
        return {**model_shards(gpt, rank, world, tp_group), **optimizer_shards(gpt, opt, rank, world, tp_group)}
    if _tensor_parallel(gpt):
        return _zero_tp_shards(z, gpt, rank, world, tp_group)
    out = {}
    for key, t in z.state_dict()["tensors"].items():
        kind, name = key.split(".", 1)
        out[_ZERO_KEYS[kind] + name] = C.ShardedArray(t["shape"], t["dtype"], t["start"], t["stop"], t["data"])
    return out


def _tensor_parallel(gpt) -> bool:
    return any(getattr(p, "tp_layout", None) is not None and p.tp_layout.tp > 1 for p in gpt.parameters())


def _zero_tp_shards(z, gpt, rank: int, world: int, tp_group) -> dict[str, C.ShardedArray]:
    """ZeRO over the data-parallel ranks of a tensor-parallel model: each tensor's ZeRO ranges
    (disjoint over the group that shards it, together the whole tensor-parallel shard) are summed
    into the shard, the shards gathered whole over ``tp_group``, and this rank writes its even share of
    the whole tensor, so the checkpoint is one device's and loads on any grid.  Collective:
    every rank visits every tensor in one order."""
    import helios.comm as dist
    from helios.schedule.tensor_parallel import full_shape, gather_full

    params = dict(gpt.named_parameters())
    tensors = z.state_dict()["tensors"]
    out = {}
    for key in sorted(tensors):
        t = tensors[key]
        kind, name = key.split(".", 1)
        p = params[name]
        shard = np.zeros(int(np.prod(t["shape"])), np.float32)
        shard[t["start"]:t["stop"]] = t["data"]
        # over the ranks that shard it (a subgroup for experts replicated over fewer ranks)
        dist.all_reduce(shard, group=z.replica_group(name))
        whole = gather_full(p, shard, tp_group)
        lo, hi = C.even_range(whole.size, rank, world)
        out[_ZERO_KEYS[kind] + name] = C.ShardedArray(full_shape(p), "float32", lo, hi, whole[lo:hi])
    return out


def model_shards(gpt, rank: int, world: int, tp_group=None) -> dict[str, C.ShardedArray]:
    """This rank's even share of every parameter (parameters are replicated on every rank, or
    gathered whole from the tensor-parallel shards first)."""
    from helios.schedule.tensor_parallel import full_shape, gather_full

    out = {}
    for name, p in gpt.named_parameters():
        shape = full_shape(p)
        lo, hi = C.even_range(int(np.prod(shape)), rank, world)
        if shape == tuple(p.shape):
            data = _raw(p, lo, hi)  # each rank reads only the part it writes
        else:
            data = gather_full(p, _raw(p, 0, p.numel()), tp_group)[lo:hi]
        out[f"model.{name}"] = C.ShardedArray(shape, _dtype_name(p), lo, hi, data)
    return out


def _raw(t, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of a tensor's flattened stored elements, read from the device alone
    (bfloat16 as its uint16 bits): each rank reads only the part it writes."""
    from helios import flat

    return flat.read(t, lo, hi)


def optimizer_shards(gpt, opt, rank: int, world: int, tp_group=None) -> dict[str, C.ShardedArray]:
    """The optimizer's moments: the ranges this rank holds (ZeRO) or its even share (replicated;
    gathered whole from the tensor-parallel shards first)."""
    from helios.schedule.tensor_parallel import full_shape, gather_full

    names = {id(p): n for n, p in gpt.named_parameters()}
    out = {}
    for fg in opt.flat:
        for p, off in zip(fg.params, fg.offsets):
            shape = full_shape(p)
            lo, hi = C.even_range(int(np.prod(shape)), rank, world)
            for j, m in enumerate(MOMENTS):
                if shape == tuple(p.shape):
                    data = _raw(fg.moments[j], off + lo, off + hi)
                else:
                    data = gather_full(p, _raw(fg.moments[j], off, off + p.numel()), tp_group)[lo:hi]
                out[f"optim.{m}.{names[id(p)]}"] = C.ShardedArray(shape, "float32", lo, hi, data)
    return out


def training_meta(opt, loader, step: int, run_meta: dict, world: int, zero: int) -> dict:
    """What a resumed run needs besides tensors (JSON)."""
    return {**run_meta, "step": step, "optimizer": {"step": opt.step_count, "groups": opt._hyper()},
            "rng": hrandom.get_rng_state(), "loader": loader.state_dict(), "world_size": world, "zero": zero}


def check_same_model(ckpt_dir: str, gpt) -> None:
    """CheckpointError naming the first parameter whose name or shape differs from the checkpoint's."""
    from helios.schedule.tensor_parallel import full_shape

    saved = {n[len("model."):]: tuple(s) for n, (s, _) in C.global_shapes(ckpt_dir).items() if n.startswith("model.")}
    mine = {n: full_shape(p) for n, p in gpt.named_parameters()}
    for n in list(mine) + [k for k in saved if k not in mine]:
        if saved.get(n) != mine.get(n):
            raise CheckpointError(
                f"--resume: {ckpt_dir} holds another model: parameter {n!r} is "
                f"{'absent' if n not in saved else saved[n]} there and {'absent' if n not in mine else mine[n]} here; "
                "point --out at a run of this model or drop --resume")


def load_training(ckpt_dir: str, gpt, opt, loader, tp_rank: int = 0) -> dict:
    """Restore parameters, moments, RNG and loader position from a sharded checkpoint; returns its meta.

    A tensor-parallel model reads each whole tensor and keeps the shard of ``tp_rank``."""
    from helios import flat
    from helios.autograd.tape import no_grad
    from helios.schedule.tensor_parallel import full_shape, take_shard

    check_same_model(ckpt_dir, gpt)
    z = _zero(opt)
    if z is not None:  # this rank reads the ranges it owns; loading is collective (it gathers parameters)
        ranges = z.shard_ranges()
        keys = {key: _ZERO_KEYS[key.split(".", 1)[0]] + key.split(".", 1)[1] for key in ranges}
        if _tensor_parallel(gpt):  # whole tensors, then this rank's tensor-parallel shard, then its ZeRO range
            params = dict(gpt.named_parameters())
            whole = {k: (0, int(np.prod(full_shape(params[k.split(".", 1)[1]])))) for k in ranges}
            arrays, meta = C.load(ckpt_dir, {keys[k]: span for k, span in whole.items()})
            mine = {}
            for k, (_, lo, hi) in ranges.items():
                shard = take_shard(params[k.split(".", 1)[1]], arrays[keys[k]], tp_rank)
                mine[k] = shard[lo:hi].astype(np.float32)
        else:
            arrays, meta = C.load(ckpt_dir, {keys[k]: (lo, hi) for k, (_, lo, hi) in ranges.items()})
            mine = {k: arrays[keys[k]].astype(np.float32) for k in ranges}
        o = meta["optimizer"]
        z.load_shard_state({"step": int(o["step"]), "param_groups": o["groups"], "tensors": mine})
        hrandom.set_rng_state(meta["rng"])
        loader.load_state_dict(meta["loader"])
        return meta
    named = list(gpt.named_parameters())
    wanted = {f"model.{n}": (0, int(np.prod(full_shape(p)))) for n, p in named}
    for n, p in named:
        for m in MOMENTS:
            wanted[f"optim.{m}.{n}"] = (0, int(np.prod(full_shape(p))))
    arrays, meta = C.load(ckpt_dir, wanted)
    mine = {k: take_shard(p, arrays[k], tp_rank) for n, p in named for k in [f"model.{n}"] + [f"optim.{m}.{n}" for m in MOMENTS]}
    with no_grad():
        for n, p in named:
            flat.copy_into(p, flat.from_numpy(mine[f"model.{n}"].reshape(p.shape), p.dtype, p.device))
            flat.mark_written(p)
    moments = {id(p): [mine[f"optim.{m}.{n}"] for m in MOMENTS] for n, p in named}
    for fg in opt.flat:
        for j in range(2):
            host = np.concatenate([moments[id(p)][j] for p in fg.params]) if fg.params else np.empty(0, np.float32)
            flat.copy_into(fg.moments[j], flat.from_numpy(host.astype(np.float32), fg.moments[j].dtype, fg.p.device))
    o = meta["optimizer"]
    opt.step_count = int(o["step"])
    for g, h in zip(opt.param_groups, o["groups"]):
        g.update({k: (tuple(v) if k == "betas" else v) for k, v in h.items()})
    hrandom.set_rng_state(meta["rng"])
    loader.load_state_dict(meta["loader"])
    return meta


# ---- the data-parallel comm hook's state (gradient compression) ---------------------------
def comm_hook_shards(hook, rank: int) -> dict[str, C.ShardedArray]:
    """This rank's compression state, whole, as ``comm_hook.rank<r>.<name>`` (error feedback is
    each rank's own, so every rank writes its own arrays); empty without a stateful hook."""
    if hook is None or not hasattr(hook, "state_dict"):
        return {}
    return {f"comm_hook.rank{rank}.{k}": C.ShardedArray((v.size,), "float32", 0, v.size, v)
            for k, v in hook.state_dict()["tensors"].items()}


def comm_hook_meta(hook, world: int) -> dict | None:
    """What a resumed run needs to find the hook's arrays (its spec, step count, array sizes)."""
    if hook is None or not hasattr(hook, "state_dict"):
        return None
    sd = hook.state_dict()
    return {"spec": sd["spec"], "steps": sd["steps"], "world_size": world,
            "tensors": {k: int(v.size) for k, v in sd["tensors"].items()}}


def load_comm_hook(ckpt_dir: str, meta: dict, hook, rank: int, world: int) -> str | None:
    """Restore this rank's compression state from a checkpoint's ``meta`` and arrays.

    Returns None when it was restored (or there is none to restore), else one line saying
    why the hook starts afresh: the checkpoint has no state of this hook (another
    --grad-compression, or none), or was written by another number of ranks (error
    feedback belongs to the rank that accumulated it)."""
    saved = meta.get("comm_hook")
    if hook is None or not hasattr(hook, "load_state_dict"):
        return None
    if saved is None or saved["spec"] != hook.spec:
        was = f"state of {saved['spec']}" if saved else "no compression state"
        return f"the checkpoint holds {was}; {hook.spec} starts afresh (its warm-up included)"
    if int(saved["world_size"]) != world:
        return (f"the checkpoint's {hook.spec} state belongs to {saved['world_size']} ranks, this run has {world}; "
                "it starts afresh (its warm-up included)")
    keys = {k: f"comm_hook.rank{rank}.{k}" for k in saved["tensors"]}
    arrays, _ = C.load(ckpt_dir, {key: (0, int(saved["tensors"][k])) for k, key in keys.items()})
    hook.load_state_dict({"spec": saved["spec"], "steps": saved["steps"],
                          "tensors": {k: arrays[key] for k, key in keys.items()}})
    return None
