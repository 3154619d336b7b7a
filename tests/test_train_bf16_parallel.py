"""helios-train --dtype bf16 with tensor parallelism and ZeRO trains what one rank trains in bf16
(with a pipeline and with experts: test_train_bf16_pp.py).

The split model sums its partial products in another order than one rank does and bfloat16
rounds each matmul's inputs to 8 bits of mantissa, so the losses are compared loosely (a
relative 2e-4; measured about 5e-5 apart over 6 steps).  That alone cannot tell bf16 from
float32 on a 6-step nano run (they are 3e-5 apart), so each layout's bf16 run must also show
16-bit products in its profiled step's kernels (``cast+...``: products that round their fp32
operands), which the same layout in fp32 never dispatches."""

from __future__ import annotations

import os
import sqlite3
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_train_dist import launch, losses  # noqa: E402

pytestmark = [pytest.mark.vulkan, pytest.mark.multiproc]

STEPS = ("--steps", "6")


def _kernels(out) -> set:
    """The kernels the profiled step dispatched (run.db's gpu_timeline)."""
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return {r[0] for r in con.execute("SELECT DISTINCT name FROM gpu_timeline")}
    finally:
        con.close()


def test_bf16_with_tp_trains_what_one_rank_trains_in_bf16(tmp_path):
    one = tmp_path / "one"
    assert launch(1, one, *STEPS, "--dtype", "bf16").returncode == 0
    for name, world, extra in (("tp2", 2, ("--tp", "2")),):
        runs = {}
        for dtype in ("bf16", "fp32"):
            out = runs[dtype] = tmp_path / f"{name}_{dtype}"
            r = launch(world, out, *STEPS, "--dtype", dtype, "--profile-steps", "3:4", *extra)
            assert r.returncode == 0, r.stderr[-3000:]
        np.testing.assert_allclose(losses(runs["bf16"]), losses(one), rtol=2e-4, err_msg=name)
        # the bf16 run's products are 16-bit ones that round their fp32 operands (the split linears'
        # weights): kernels the fp32 run never dispatches
        bf16, fp32 = _kernels(runs["bf16"]), _kernels(runs["fp32"])
        assert any(k.startswith("cast+") for k in bf16), (name, sorted(bf16))
        assert not any(k.startswith("cast+") for k in fp32), (name, sorted(fp32))
