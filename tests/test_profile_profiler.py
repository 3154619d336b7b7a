"""profile(): the runtime hook, key_averages tables, the HELIOS_DEBUG line formatter."""

from __future__ import annotations

import io

import pytest
from helios.profile import (
    ProfileError,
    current_collector,
    format_kernel_line,
    log_kernel,
    parse_profile_steps,
    profile,
    register_runtime_hooks,
    unregister_runtime_hooks,
)
from helios.profile.debug import debug_level
from test_profile_synth import FakeClock, FakeRuntime


def _session():
    clock = FakeClock()
    with profile(clock=clock) as prof:
        rt = FakeRuntime(clock, seed=1)
        rt.op("matmul", ((8, 16), (16, 32)), "f32", 2 * 8 * 16 * 32, 4 * (8 * 16 + 16 * 32 + 8 * 32))
        rt.op("matmul", ((8, 32), (32, 4)), "f32", 2 * 8 * 32 * 4, 4 * (8 * 32 + 32 * 4 + 8 * 4))
        rt.op("softmax", (8, 4), "f32", 5 * 32, 8 * 32, n_dispatch=2)
        # A dispatch no host op claims (a runtime-internal copy).
        col = current_collector()
        rt.pending.append({"name": "staging_copy", "flops": 0, "bytes": 4096, "host_record_ns": clock(),
                           "dispatch_seq": col.next_dispatch_seq()})
        rt.synchronize()
    return prof


def test_collector_is_active_only_inside_profile() -> None:
    assert current_collector() is None
    with profile() as prof:
        assert current_collector() is prof.collector
        with pytest.raises(ProfileError, match="do not nest"), profile():
            pass
    assert current_collector() is None
    with pytest.raises(KeyError), profile():
        raise KeyError("x")
    assert current_collector() is None  # cleared on error too


def test_runtime_hooks_run_at_start_and_stop() -> None:
    calls = []

    def on_start(col):
        calls.append(("start", col is current_collector()))

    def on_stop(col):
        # The runtime pushes its last events here, while the session is still open.
        col.add_device_events({"events": [{"name": "k", "flops": 1, "bytes": 2, "start_ns": 5, "end_ns": 9,
                                           "submit": 0, "host_record_ns": 1}], "submits": []})
        calls.append(("stop", col is current_collector()))

    register_runtime_hooks(on_start, on_stop)
    register_runtime_hooks(on_start, on_stop)  # idempotent
    try:
        with profile() as prof:
            pass
    finally:
        unregister_runtime_hooks(on_start, on_stop)
    assert calls == [("start", True), ("stop", True)]
    assert len(prof.collector.events) == 1 and prof.collector.end_ns is not None
    with profile():
        pass
    assert len(calls) == 2  # unregistered


def test_key_averages_totals_and_table() -> None:
    prof = _session()
    rows = {r.name: r for r in prof.key_averages()}
    col = prof.collector
    assert set(rows) == {"matmul", "softmax", "staging_copy"}
    mm = rows["matmul"]
    assert mm.calls == 2 and mm.dispatches == 2
    mm_events = [e for e in col.events if e.name.startswith("matmul")]
    assert mm.device_time_ns == sum(e.device_ns for e in mm_events)
    assert mm.flops == 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4
    assert mm.host_time_ns == sum(op.host_ns for op in col.ops if op.name == "matmul")
    assert mm.gflops_per_s == pytest.approx(mm.flops / mm.device_time_ns)
    assert rows["softmax"].dispatches == 2 and rows["softmax"].calls == 1
    assert rows["staging_copy"].calls == 1 and rows["staging_copy"].host_time_ns == 0
    assert sum(r.device_time_ns for r in rows.values()) == sum(e.device_ns for e in col.events)

    table = prof.key_averages().table(sort_by="device_time", row_limit=2)
    lines = table.splitlines()
    assert "Name" in lines[1] and "GFLOP/s" in lines[1] and "GB/s" in lines[1]
    body = lines[3:5]
    by_dev = sorted(rows.values(), key=lambda r: (-r.device_time_ns, r.name))
    assert [ln.split()[0] for ln in body] == [by_dev[0].name, by_dev[1].name]
    assert "Rows: 2 of 3" in table
    all_rows = prof.key_averages().table(sort_by="name", row_limit=0).splitlines()
    assert len(all_rows) == 8 and [ln.split()[0] for ln in all_rows[3:6]] == ["matmul", "softmax", "staging_copy"]
    assert prof.key_averages().sorted_by("cuda_time_total")[0].name == by_dev[0].name  # alias
    with pytest.raises(ProfileError, match="sort_by='nope' is not a column"):
        prof.key_averages().table(sort_by="nope")


def test_group_by_shape_splits_rows() -> None:
    prof = _session()
    shapes = {(r.name, r.shape) for r in prof.key_averages(group_by_shape=True)}
    assert ("matmul", "(8, 16)x(16, 32)") in shapes and ("matmul", "(8, 32)x(32, 4)") in shapes
    table = prof.key_averages(group_by_shape=True).table()
    assert "Shape" in table and "(8, 16)x(16, 32)" in table


def test_parse_profile_steps() -> None:
    assert parse_profile_steps("10:20") == range(10, 20)
    assert parse_profile_steps("7") == range(7, 8)
    assert parse_profile_steps(":3") == range(3)
    assert 10**9 in parse_profile_steps("5:")
    for bad in ("20:10", "a:b", "-1:4", ""):
        with pytest.raises(ProfileError):
            parse_profile_steps(bad)


def test_debug_line_format_and_levels(monkeypatch) -> None:
    line = format_kernel_line("matmul", "(64, 768)x(768, 3072)", 412_300, 302_000_000_000 // 1000, 5_000_000, "f32")
    assert line.startswith("helios: matmul") and "(64, 768)x(768, 3072)" in line and "f32" in line
    assert "412.30 us" in line
    assert f"{302_000_000 / 412_300:.2f} GFLOP/s" in line and f"{5_000_000 / 412_300:.2f} GB/s" in line
    assert "src=" not in line
    l2 = format_kernel_line("matmul", "(2, 2)", 2_500_000, 0, 64, "f32", level=2, source="glsl/matmul.comp",
                            binary="spv/matmul.spv")
    assert "2.500 ms" in l2 and "n/a GFLOP/s" in l2 and "src=glsl/matmul.comp  spv=spv/matmul.spv" in l2
    assert "n/a GB/s" in format_kernel_line("k", "()", 0, 10, 10)

    monkeypatch.delenv("HELIOS_DEBUG", raising=False)
    buf = io.StringIO()
    assert debug_level() == 0 and not log_kernel("k", "(1,)", 10, 1, 1, stream=buf) and buf.getvalue() == ""
    monkeypatch.setenv("HELIOS_DEBUG", "2")
    assert debug_level() == 2 and log_kernel("k", "(1,)", 10, 1, 1, source="a.comp", stream=buf)
    assert buf.getvalue().count("\n") == 1 and "src=a.comp" in buf.getvalue()
    monkeypatch.setenv("HELIOS_DEBUG", "yes")
    assert debug_level() == 0
