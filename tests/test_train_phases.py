"""Device marks: timestamps in the command stream, resolved without waiting."""

import numpy as np
import pytest

import helios as hl
from helios.runtime import HostRuntime, get_runtime

pytestmark = pytest.mark.vulkan

def test_marks_time_device_work_in_order_and_resolve_once_it_finished():
    rt = get_runtime()
    assert rt.has_marks  # lavapipe's compute queue writes timestamps
    a = hl.tensor(np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32))
    first = rt.mark()
    for _ in range(4):
        a = a @ a * 0.01
    ids = [first] + [rt.mark() for _ in range(70)]  # more than one command buffer's 64 mark queries
    rt.wait_mark(ids[-1])
    times = rt.take_marks()
    assert set(ids) <= set(times)
    got = [times[i] for i in ids]
    assert got == sorted(got) and got[1] > got[0]  # the matmuls took device time between the first two
    assert rt.take_marks() == {}  # each mark is handed out once
    assert HostRuntime().mark() is None  # no device timestamps: callers synchronise instead
