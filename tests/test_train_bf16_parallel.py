"""helios-train --dtype bf16 with tensor parallelism and ZeRO trains what one rank trains in bf16
(with a pipeline and with experts: test_train_bf16_pp.py).

The split model sums its partial products in another order than one rank does and bfloat16
rounds each matmul's inputs to 8 bits of mantissa, so the losses are compared loosely (a
relative 2e-4; measured about 5e-5 apart over 6 steps).  That alone cannot tell bf16 from
float32 on a 6-step nano run (they are 3e-5 apart), so each layout's bf16 run must also
record the casts autocast adds: more kernel launches per step than the same layout in fp32."""

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


def _dispatches(out) -> int:
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return con.execute("SELECT dispatches FROM step_timing WHERE rank = 0 AND step = 3").fetchone()[0]
    finally:
        con.close()


def test_bf16_with_tp_trains_what_one_rank_trains_in_bf16(tmp_path):
    one = tmp_path / "one"
    assert launch(1, one, *STEPS, "--dtype", "bf16").returncode == 0
    for name, world, extra in (("tp2", 2, ("--tp", "2")),):
        runs = {}
        for dtype in ("bf16", "fp32"):
            out = runs[dtype] = tmp_path / f"{name}_{dtype}"
            r = launch(world, out, *STEPS, "--dtype", dtype, *extra)
            assert r.returncode == 0, r.stderr[-3000:]
        np.testing.assert_allclose(losses(runs["bf16"]), losses(one), rtol=2e-4, err_msg=name)
        bf16, fp32 = _dispatches(runs["bf16"]), _dispatches(runs["fp32"])
        # autocast's casts that are still kernels of their own (the attention scores to fp32 for the
        # softmax and back, the logits; the linears' casts ride in their products): 34 a step here
        assert bf16 > fp32 + 20, (name, bf16, fp32)
