"""ZeroAdamW's state going in and out: the full parameters, the sharded state dict and its
loader (any world size or stage: each rank reads its own ranges), the moments by parameter
for helios-train's checkpoint code, and the bytes the sharded buffers hold beside the ZeRO
formulas.

Its one job is reading and writing the buffers a ``ZeroAdamW`` built; it decides no layout
and launches no reduction of its own.  ``ZeroStateIO(opt)`` reads the optimizer's plan
(``opt.groups``, ``opt.units``, ``opt.plan.ranges()``: which elements this rank owns and where
they live) and uses its stage-3 gather / release (``opt.unit_params``) and ``settle()`` (finish
the reductions in flight) before it reads.  The formats are the module docstring of
``helios.schedule.zero``.  ``TransientBytes`` counts the buffers that come and go (gradient
staging, gathered units) for ``memory_report``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

import helios.comm as dist
from helios import dtypes as dt
from helios import flat
from helios.autograd.tape import no_grad
from helios.errors import CheckpointError
from helios.schedule.zero_plan import view_f32

if TYPE_CHECKING:
    from helios.schedule.zero import ZeroAdamW

_F32 = dt.float32


class ZeroStateIO:
    """Reads and writes one ``ZeroAdamW``'s parameters and moments by name and global range."""

    def __init__(self, opt: ZeroAdamW) -> None:
        self.opt = opt

    def full_parameters(self) -> dict:
        """``{name: ndarray}`` of every trainable parameter, full size (at stage 3 every rank must call
        it: it gathers one unit at a time)."""
        opt = self.opt
        opt.settle()
        out = {}
        if opt.stage == 3:
            for u in opt.units:
                opt.unit_params.gather(u, wait=True)
                for s in u.segs:
                    for p in s.params:
                        out[opt.plan.name[id(p)]] = p.numpy()
                opt.unit_params.release(u)
        else:
            for g in opt.groups:
                for s in g.segs:
                    for p in s.params:
                        out[opt.plan.name[id(p)]] = p.numpy()
        return {n: out[n] for n in opt.plan.name.values() if n in out}

    def shard_ranges(self) -> dict:
        """``{KEY: (global shape, start, stop)}``: the flat range of each tensor this rank owns."""
        out = {}
        for name, p, _, _, start, stop in self.opt.plan.ranges(self.opt.groups):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                out[f"{kind}.{name}"] = (tuple(p.shape), start, stop)
        return out

    def _where(self, s, a: int, start: int) -> tuple:
        """(storage, element offset) of the parameter element ``start`` of a parameter at ``a`` in ``s``."""
        opt = self.opt
        g = opt.groups[s.gi]
        shard_off = s.so + a + start - s.rank * s.c
        if opt.stage == 3:
            return g.pshard.untyped_storage(), shard_off
        return s.pfull, s.po + a + start

    def state_dict(self) -> dict:
        """This rank's shard of the parameters and moments, with the global ranges (module docstring)."""
        opt = self.opt
        opt.settle()
        host = {id(g.m): g.m.numpy() for g in opt.groups}
        host.update({id(g.v): g.v.numpy() for g in opt.groups})
        pshard = {gi: g.pshard.numpy() for gi, g in enumerate(opt.groups) if g.pshard is not None}
        pflat = {gi: g.pflat.numpy() for gi, g in enumerate(opt.groups) if g.pflat is not None}
        tensors = {}
        for name, p, s, a, start, stop in opt.plan.ranges(opt.groups):
            g = opt.groups[s.gi]
            so = s.so + a + start - s.rank * s.c
            n = stop - start
            if opt.stage == 3:
                pdata = pshard[s.gi][so: so + n]
            else:
                pdata = pflat[s.gi][s.po + a + start: s.po + a + start + n]
            for kind, data in (("param", pdata), ("exp_avg", host[id(g.m)][so: so + n]),
                               ("exp_avg_sq", host[id(g.v)][so: so + n])):
                tensors[f"{kind}.{name}"] = {"shape": tuple(p.shape), "dtype": "float32", "start": start, "stop": stop,
                                             "data": np.array(data, np.float32)}
        groups = [{**h, "params": [opt.plan.name[id(p)] for p in g["params"]]}
                  for h, g in zip(opt._hyper(), opt.param_groups)]
        return {"stage": opt.stage, "world_size": opt.world, "rank": opt.rank, "step": opt.step_count,
                "param_groups": groups, "tensors": tensors}

    @no_grad()
    def load_shard_state(self, sd: dict) -> None:
        """Load this rank's ranges (``shard_ranges()``) of every tensor; collective (module docstring)."""
        opt = self.opt
        opt.settle()
        tensors = sd.get("tensors", {})
        arrays = {}
        for key, (shape, start, stop) in self.shard_ranges().items():
            if key not in tensors:
                raise CheckpointError(f"ZeroAdamW.load_shard_state: {key} is missing (this rank needs its elements "
                                      f"[{start}, {stop}) of shape {shape})")
            x = tensors[key]
            x = x["data"] if isinstance(x, dict) else x
            x = np.ascontiguousarray(np.asarray(x, np.float32).reshape(-1))
            if x.size != stop - start:
                raise CheckpointError(f"ZeroAdamW.load_shard_state: {key} has {x.size} elements, this rank's range "
                                      f"[{start}, {stop}) of shape {shape} needs {stop - start}")
            arrays[key] = x
        groups = sd.get("param_groups")
        if groups is not None and len(groups) != len(opt.param_groups):
            raise CheckpointError(f"ZeroAdamW.load_shard_state: {len(groups)} parameter groups in the state, "
                                  f"{len(opt.param_groups)} in this optimizer")
        for name, p, s, a, start, stop in opt.plan.ranges(opt.groups):
            n = stop - start
            if not n:
                continue
            g = opt.groups[s.gi]
            so = s.so + a + start - s.rank * s.c
            st, off = self._where(s, a, start)
            for (dst, doff), key in (((st, off), f"param.{name}"), ((g.m.untyped_storage(), so), f"exp_avg.{name}"),
                                     ((g.v.untyped_storage(), so), f"exp_avg_sq.{name}")):
                flat.copy_into(view_f32(dst, doff, n), flat.from_numpy(arrays[key], _F32, opt.rt))
        if opt.stage <= 2:
            works = [dist.all_gather(view_f32(s.pfull, s.po, s.world * s.c),
                                     view_f32(s.pfull, s.po + s.rank * s.c, s.c), group=s.pg, async_op=True)
                     for g in opt.groups for s in g.segs]
            for w in works:
                w.wait()
        for g in opt.groups:
            for s in g.segs:
                flat.mark_written(s.pfull)  # the all-gathers wrote behind the ops' back
        if groups is not None:
            for g, h in zip(opt.param_groups, groups):
                g.update({k: (tuple(v) if k == "betas" else v) for k, v in h.items() if k != "params"})
        if "step" in sd:
            opt.step_count = int(sd["step"])

    # The interface of helios-train's checkpoint code (schedule/train_state.py): the moments by parameter.
    def moment_ranges(self) -> dict:
        """``{id(parameter): (start, stop)}``: the flat range of each parameter whose moments this rank holds."""
        return {id(p): (start, stop) for _, p, _, _, start, stop in self.opt.plan.ranges(self.opt.groups)}

    def moment_shards(self) -> list:
        """``[(parameter, "exp_avg" | "exp_avg_sq", start, stop, float32 ndarray)]`` for this rank's ranges."""
        sd = self.state_dict()["tensors"]
        out = []
        for name, p, _, _, start, stop in self.opt.plan.ranges(self.opt.groups):
            for kind in ("exp_avg", "exp_avg_sq"):
                out.append((p, kind, start, stop, sd[f"{kind}.{name}"]["data"]))
        return out

    @no_grad()
    def load_moment_shards(self, moments: dict) -> None:
        """Load ``{id(parameter): [exp_avg, exp_avg_sq]}``, each the ``moment_ranges()`` range of the moment."""
        opt = self.opt
        for name, p, s, a, start, stop in opt.plan.ranges(opt.groups):
            n = stop - start
            arrs = moments.get(id(p))
            if arrs is None or any(np.asarray(x).size != n for x in arrs):
                raise CheckpointError(f"ZeroAdamW: the moments of {name} must cover elements [{start}, {stop})")
            g = opt.groups[s.gi]
            so = s.so + a + start - s.rank * s.c
            for t, x in zip((g.m, g.v), arrs):
                if n:
                    flat.copy_into(flat.elements(t, so, n),
                                   flat.from_numpy(np.asarray(x, np.float32).reshape(-1), _F32, opt.rt))

    # ---- bytes -----------------------------------------------------------------------------------
    def expected_memory(self) -> dict:
        """The ZeRO formula's bytes per category at the padded Psi this layout uses (what ``requested`` is).
        With ``param_replicas`` each segment counts over its own group: full 4 x N_s x c, shard 4 x c."""
        opt = self.opt
        if not opt.plan.replicas:
            return state_bytes_formula(opt.stage, opt.padded_numel, opt.world)
        full = 4 * sum(g.full_n for g in opt.groups)
        shard = 4 * sum(g.shard_n for g in opt.groups)
        return {"params": shard if opt.stage == 3 else full, "grads": full if opt.stage == 1 else shard,
                "moments": 2 * shard}


class TransientBytes:
    """Pool bytes of the buffers that come and go, by kind (``"grad_staging"``,
    ``"gathered_params"``): now and at their peak."""

    def __init__(self, kinds) -> None:
        self._by_kind = {k: {"now": 0, "peak": 0} for k in kinds}

    def count(self, kind: str, delta: int) -> None:
        """``delta`` bytes of ``kind`` taken (positive) or given back (negative)."""
        t = self._by_kind[kind]
        t["now"] += delta
        t["peak"] = max(t["peak"], t["now"])

    def now(self, kind: str) -> int:
        """Bytes of ``kind`` held now."""
        return self._by_kind[kind]["now"]

    def report(self) -> dict:
        """``{kind: {"now": bytes, "peak": bytes}}`` (a copy)."""
        return {k: dict(v) for k, v in self._by_kind.items()}


def state_bytes_formula(stage: int, psi: int, n: int) -> dict:
    """ZeRO's bytes of model states a rank holds, by category (params, grads, moments), for ``psi``
    float32 parameters over ``n`` ranks at ``stage`` (1, 2 or 3)."""
    full, shard = 4 * psi, 4 * psi // n
    return {"params": shard if stage == 3 else full, "grads": full if stage == 1 else shard, "moments": 2 * shard}


def memory_report(opt: ZeroAdamW) -> dict:
    """Bytes this rank holds for the model states, by category, beside the ZeRO formulas.

    ``held[cat]`` has ``formula`` (the fp32 formula at Psi: params 4Psi or 4Psi/N, grads 4Psi
    or 4Psi/N, moments 8Psi/N), ``formula_padded`` (the same at the padded Psi this layout
    uses), ``requested`` (bytes asked of the pool), ``pool`` (bytes the pool's size classes
    hold for them, measured from ``pool_stats()`` as each buffer was allocated) and
    ``buffers`` (the requested size of each buffer).  ``weights_pool_in_use`` is the weights
    pool's current total (this optimizer's buffers are all it holds unless something else put
    tensors there).  ``transient`` has the staging bytes of stage-2/3 gradients and the
    gathered stage-3 parameters, now and at their peak, and ``largest_unit_bytes``.
    """
    psi, n = opt.numel, opt.world
    f, fp = state_bytes_formula(opt.stage, psi, n), state_bytes_formula(opt.stage, opt.padded_numel, n)
    held = {}
    for cat in ("params", "grads", "moments"):
        b = opt._bytes[cat]
        held[cat] = {"formula": f[cat], "formula_padded": fp[cat], "requested": b["requested"], "pool": b["pool"],
                     "buffers": list(b["buffers"])}
    held["total"] = {k: sum(held[c][k] for c in ("params", "grads", "moments"))
                     for k in ("formula", "formula_padded", "requested", "pool")}
    return {"stage": opt.stage, "world_size": n, "rank": opt.rank, "numel": psi, "padded_numel": opt.padded_numel,
            "held": held, "weights_pool_in_use": flat.pool_in_use(opt.rt, "weights"),
            "transient": opt.transient.report(),
            "largest_unit_bytes": opt.largest_unit_bytes() if opt.stage == 3 else 0}


__all__ = ["TransientBytes", "ZeroStateIO", "memory_report"]
