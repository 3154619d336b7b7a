"""helios-doctor: the CLI's JSON, the addon checked against the `vulkan` bindings, and each probe's failure path."""

import copy
import json
import os
import subprocess
import sys

import pytest

import helios.comm as dist
from helios.doctor import cli, probe_comm, probe_cuda, probe_kernels, probe_vulkan, vk_bindings, vk_compare
from helios.doctor.report import MARKS, Section, to_json_dict, to_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "helios-doctor")


def _doctor(*args, env=None, timeout=120):
    """Run the installed console script (or the module where the script is missing) as a user would."""
    cmd = [SCRIPT, *args] if os.access(SCRIPT, os.X_OK) else [sys.executable, "-m", "helios.doctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


def _check(section: Section, name: str):
    hits = [c for c in section.checks if c.name == name]
    assert hits, f"no check {name!r} in {[c.name for c in section.checks]}"
    return hits[0]


# A lavapipe-like device as the addon's enumerate_devices() gives it (tuples where pybind11 makes them).
LAVAPIPE = {
    "index": 0, "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "type": "cpu", "vendor_id": 0x10005, "device_id": 0,
    "driver_version": 1, "api_version": "1.3.230", "pipeline_cache_uuid": "76616c2d257300000000000000000000",
    "limits": {"max_storage_buffer_range": 1 << 27, "max_shared_memory": 32768, "max_workgroup_invocations": 1024,
               "max_workgroup_size": (1024, 1024, 1024), "max_workgroup_count": (65535, 65535, 65535),
               "max_push_constants": 128, "min_storage_buffer_offset_alignment": 16, "timestamp_period": 1.0,
               "timestamp_valid_bits": 64, "subgroup_size": 8, "min_subgroup_size": 8, "max_subgroup_size": 8,
               "max_memory_allocation_size": 1 << 31},
    "features": {"float16": True, "storage16": True, "storage8": True, "int64": True, "int16": True,
                 "push_descriptor": True, "calibrated_timestamps": True, "unified_memory": True},
    "device_local_bytes": 1 << 31,
}
EXTRA = {"driver_name": "llvmpipe", "driver_info": "Mesa", "memory_heaps": [{"size": 1 << 31, "device_local": True}],
         "memory_types": [{"heap": 0, "device_local": True, "host_visible": True, "host_coherent": True, "host_cached": True}],
         "subgroup_size_min": 8, "subgroup_size_max": 8, "cooperative_matrix_khr": False, "cooperative_matrix_nv": False,
         "cooperative_matrix_shapes": []}


class FakeAddon:
    def __init__(self, devices, error=""):
        self.devices, self.error = devices, error

    def enumerate_devices(self):
        return [dict(d) for d in self.devices]

    def last_error(self):
        return self.error


def _bindings_of(*devices):
    devs = []
    for d in devices:
        b = copy.deepcopy(d)
        b["limits"] = {k: list(v) if isinstance(v, tuple) else v for k, v in b["limits"].items()}
        b["extra"] = dict(EXTRA)
        devs.append(b)
    return lambda: {"loader_version": "1.3.239", "loader_library": "/usr/lib/libvulkan.so.1", "instance_api": "1.3.0",
                    "devices": devs}


# -- the CLI as a user runs it ----------------------------------------------------------------------


@pytest.mark.vulkan
def test_cli_json_is_one_object_with_the_schema():
    r = _doctor("--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)  # the whole of stdout is one JSON object
    assert rep["schema"] == 1 and rep["ok"] is True
    assert list(rep["sections"]) == ["vulkan", "kernels", "cuda", "comm", "python"]
    for name, sec in rep["sections"].items():
        assert set(sec) == {"title", "ok", "checks", "data"}, name
        assert sec["checks"], f"section {name} reported nothing"
        for c in sec["checks"]:
            assert set(c) == {"name", "status", "summary", "advice", "required"}
            assert c["status"] in MARKS and c["summary"]
            assert bool(c["advice"]) == (c["status"] == "fail"), c  # every ✗ says what to do, and only a ✗
        assert sec["ok"] == (not any(c["status"] == "fail" for c in sec["checks"]))
    fails = [(s, c["name"]) for s, sec in rep["sections"].items() for c in sec["checks"] if c["status"] == "fail"]
    assert [(f["section"], f["name"]) for f in rep["findings"]] == fails
    vk = rep["sections"]["vulkan"]["data"]
    assert vk["addon"] and vk["bindings"]["devices"], "lavapipe should be visible to both witnesses"
    assert vk["disagreements"] == [] and vk["picked"] == 0
    assert rep["sections"]["kernels"]["data"]["spirv"]["missing"] == []
    ladder = rep["sections"]["cuda"]["data"].get("ladder")
    if rep["sections"]["cuda"]["data"]["tools"]["ptxas"]:
        assert ladder and all(row["ok"] for row in ladder), ladder


@pytest.mark.vulkan
def test_cli_text_report_marks_sections_and_gives_advice_under_each_failure():
    r = _doctor("--no-ptx", "--no-color", env={"HELIOS_DEVICE": "vulkan:9"})
    assert r.returncode == 1, "a HELIOS_DEVICE naming no device stops the default path"
    lines = r.stdout.splitlines()
    assert lines[0] == "✗ Vulkan"
    i = next(i for i, ln in enumerate(lines) if "device Helios would use" in ln)
    assert lines[i].lstrip().startswith("✗") and "HELIOS_DEVICE=vulkan:9 names no device" in lines[i]
    assert lines[i + 1].strip().startswith("-> unset HELIOS_DEVICE or set it to one of: vulkan:0")
    assert "addon vs bindings: agree on all" in r.stdout
    assert "Helios cannot run its default (Vulkan) path here" in lines[-1]


@pytest.mark.parametrize("argv", [["--bogus"], ["--section", "nope"], ["--json", "extra"]])
def test_bad_flag_is_one_line_and_exit_2(argv):
    r = _doctor(*argv)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("helios-doctor: "), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.vulkan
def test_without_the_bindings_the_doctor_runs_and_says_how_to_install_them():
    code = ("import sys; sys.modules['vulkan'] = None  # import vulkan now raises ImportError\n"
            "from helios.doctor.cli import main; sys.exit(main(['--json', '--section', 'vulkan']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr  # the addon still finds lavapipe: Helios can run
    sec = json.loads(r.stdout)["sections"]["vulkan"]
    miss = next(c for c in sec["checks"] if c["name"] == "vulkan bindings")
    assert miss["status"] == "fail" and not miss["required"]
    assert miss["advice"].startswith("pip install 'helios[doctor]'")
    assert sec["data"]["bindings"] is None and sec["data"]["addon"], "the addon's view is still reported"
    assert "disagreements" not in sec["data"]


# -- the addon and the bindings on lavapipe --------------------------------------------------------


@pytest.mark.vulkan
def test_addon_and_bindings_agree_field_by_field():
    from helios import _vulkan

    addon = _vulkan.enumerate_devices()
    seen = vk_bindings.read_devices()
    diffs, unchecked = vk_compare.compare(addon, seen["devices"])
    assert diffs == []
    assert unchecked == [], "every field the addon reports must be recomputed by the bindings"
    assert len(addon) == len(seen["devices"]) >= 1
    assert seen["loader_library"] and "libvulkan.so" in seen["loader_library"]
    assert vk_compare.count_fields(addon[0]) == 31  # cooperative_matrix and the required-subgroup-size range included (compared too)


def test_the_bindings_read_lavapipe_as_it_is():
    seen = vk_bindings.read_devices()
    lava = [d for d in seen["devices"] if d["type"] == "cpu"]
    if not lava:  # CI always has it (scripts/setup.sh installs it); a GPU machine may not
        pytest.skip("lavapipe (Mesa's CPU Vulkan driver) is not installed here")
    x = lava[0]["extra"]
    assert x["driver_name"] == "llvmpipe" and x["driver_info"].startswith("Mesa")
    assert x["subgroup_size_min"] <= lava[0]["limits"]["subgroup_size"] <= x["subgroup_size_max"]
    assert any(t["host_visible"] and t["device_local"] for t in x["memory_types"])


def test_a_forced_disagreement_is_reported_field_by_field():
    other = copy.deepcopy(LAVAPIPE)
    other["limits"]["subgroup_size"] = 16
    other["features"]["float16"] = False
    other["limits"]["timestamp_period"] = 1.0 + 1e-9  # float noise, not a disagreement
    other["limits"]["max_workgroup_size"] = [1024, 1024, 1024]  # a list where the addon has a tuple: the same
    diffs, unchecked = vk_compare.compare([LAVAPIPE], [other])
    assert [(d.device, d.field, d.addon, d.bindings) for d in diffs] == [
        ("vulkan:0", "limits.subgroup_size", 8, 16), ("vulkan:0", "features.float16", True, False)]
    assert unchecked == []
    # A device only one side lists; a field the bindings cannot recompute is unchecked, not a disagreement.
    newer = dict(copy.deepcopy(LAVAPIPE), new_field=1)
    diffs, unchecked = vk_compare.compare([newer, LAVAPIPE], [copy.deepcopy(LAVAPIPE)])
    assert [(d.device, d.field) for d in diffs] == [("vulkan:1", "present")] and unchecked == ["new_field"]


def test_a_disagreement_is_a_finding_in_the_report():
    changed = copy.deepcopy(LAVAPIPE)
    changed["limits"]["max_storage_buffer_range"] = 1 << 30
    s = probe_vulkan.probe(env={}, addon_loader=lambda: FakeAddon([LAVAPIPE]), bindings_reader=_bindings_of(changed))
    bad = [c for c in s.checks if c.name == "addon vs bindings"]
    assert len(bad) == 1 and bad[0].status == "fail" and not bad[0].required
    assert "vulkan:0 limits.max_storage_buffer_range: the addon says 134217728, the vulkan bindings say 1073741824" == bad[0].summary
    assert "instance.cpp" in bad[0].advice
    assert s.data["disagreements"][0]["field"] == "limits.max_storage_buffer_range"
    agree = probe_vulkan.probe(env={}, addon_loader=lambda: FakeAddon([LAVAPIPE]), bindings_reader=_bindings_of(LAVAPIPE))
    assert _check(agree, "addon vs bindings").status == "ok"


# -- each probe's failure path, faked, with its one-line advice ------------------------------------


def test_no_vulkan_loader():
    def no_bindings_loader():
        raise OSError("cannot load library 'libvulkan.so.1': libvulkan.so.1: cannot open shared object file")

    def no_addon():
        raise ImportError("libvulkan.so.1: cannot open shared object file: No such file or directory")

    s = probe_vulkan.probe(env={}, addon_loader=no_addon, bindings_reader=no_bindings_loader)
    for name in ("loader", "native addon"):
        c = _check(s, name)
        assert c.status == "fail" and c.required
        assert c.advice == probe_vulkan.LOADER_ADVICE and "apt-get install libvulkan1" in c.advice
    assert to_json_dict([s])["ok"] is False


def test_unbuilt_addon_and_no_device():
    def unbuilt():
        raise ImportError("cannot import name '_vulkan' from 'helios'")

    s = probe_vulkan.probe(env={}, addon_loader=unbuilt, bindings_reader=_bindings_of(LAVAPIPE))
    assert _check(s, "native addon").advice == probe_vulkan.ADDON_ADVICE
    s = probe_vulkan.probe(env={}, addon_loader=lambda: FakeAddon([], "vkEnumeratePhysicalDevices found no Vulkan device"),
                           bindings_reader=_bindings_of())
    c = _check(s, "devices")
    assert c.required and "found no Vulkan device" in c.summary and "mesa-vulkan-drivers" in c.advice


def test_kernel_needs_of_a_weak_device():
    weak = copy.deepcopy(LAVAPIPE)
    weak.update(api_version="1.1.0")
    weak["features"].update(int64=False, storage16=False)
    weak["limits"].update(timestamp_valid_bits=0)
    s = probe_vulkan.probe(env={}, addon_loader=lambda: FakeAddon([weak]), bindings_reader=_bindings_of(weak))
    failed = {c.name: c for c in s.failed}
    assert failed["vulkan:0 Vulkan >= 1.2"].required
    assert not failed["vulkan:0 int64 (shaderInt64)"].required and "int32" in failed["vulkan:0 int64 (shaderInt64)"].advice
    assert "float32" in failed["vulkan:0 16-bit storage"].advice
    assert "step timers still work" in failed["vulkan:0 timestamps"].advice
    assert _check(s, "vulkan:0 workgroups of 256").status == "ok"


@pytest.mark.parametrize("spec, ok, text", [
    (None, True, "HELIOS_DEVICE is unset"), ("vulkan:1", True, "HELIOS_DEVICE=vulkan:1"), ("vulkan", True, "vulkan:0"),
    ("vulkan:5", False, "names no device (2 here)"), ("cuda:0", False, "is not 'vulkan' or 'vulkan:N'"),
])
def test_the_device_helios_would_pick(spec, ok, text):
    gpu = dict(copy.deepcopy(LAVAPIPE), index=1, name="Fake GPU", type="discrete")
    devs = [dict(LAVAPIPE), gpu]
    env = {} if spec is None else {"HELIOS_DEVICE": spec}
    s = probe_vulkan.probe(env=env, addon_loader=lambda: FakeAddon(devs), bindings_reader=_bindings_of(*devs))
    c = _check(s, "device Helios would use")
    assert (c.status == "ok") == ok and text in c.summary
    if not ok:
        assert c.required and "vulkan:0 (llvmpipe" in c.advice and "vulkan:1 (Fake GPU)" in c.advice


def test_lavapipe_says_its_loop_limit_and_a_gpu_does_not():
    gpu = dict(copy.deepcopy(LAVAPIPE), index=1, name="Fake GPU", type="discrete")
    s = probe_vulkan.probe(env={}, addon_loader=lambda: FakeAddon([LAVAPIPE, gpu]), bindings_reader=_bindings_of(LAVAPIPE, gpu))
    assert "after 65,535 iterations" in _check(s, "vulkan:0 loops").summary
    assert "under 60,000" in _check(s, "vulkan:0 loops").summary
    assert not [c for c in s.checks if c.name == "vulkan:1 loops"]


@pytest.mark.parametrize("env, ok, text", [
    ({}, True, "one thread per CPU"), ({"LP_NUM_THREADS": "1"}, True, "LP_NUM_THREADS=1"),
    ({"LP_NUM_THREADS": "lots"}, False, "is not a number"), ({"LP_NUM_THREADS": "100000"}, False, "exceeds"),
    ({"LOCAL_WORLD_SIZE": "64"}, False, "each of 64 local ranks"),
])
def test_lavapipe_threads(env, ok, text):
    s = probe_vulkan.probe(env=env, addon_loader=lambda: FakeAddon([LAVAPIPE]), bindings_reader=_bindings_of(LAVAPIPE))
    c = _check(s, "lavapipe threads")
    assert (c.status == "ok") == ok and text in c.summary
    if not ok:
        assert "LP_NUM_THREADS" in c.advice


def test_no_rdma_library_and_rdma_ports_from_sysfs(tmp_path):
    s = probe_comm.probe(env={}, shm=lambda: None, rdma=lambda: [],
                         ib=lambda: "libibverbs is not installed (cannot load library 'libibverbs.so.1')")
    c = _check(s, "ibverbs")
    assert c.status == "fail" and not c.required
    assert c.advice.startswith("apt-get install libibverbs1 ibverbs-providers")
    s = probe_comm.probe(env={}, shm=lambda: None, rdma=lambda: [], ib=lambda: "no RDMA device on this host")
    assert "Helios uses TCP" in _check(s, "ibverbs").advice
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    devs = probe_comm.rdma_devices(str(tmp_path))
    assert devs == [{"name": "mlx5_0", "ports": [{"port": 1, "state": "ACTIVE", "link_layer": "InfiniBand",
                                                  "rate": "200 Gb/sec (4X HDR)"}]}]
    s = probe_comm.probe(env={}, shm=lambda: None, ib=lambda: None, rdma=lambda: devs)
    assert _check(s, "ibverbs").status == "ok"
    assert _check(s, "RDMA mlx5_0").summary == "port 1 ACTIVE InfiniBand 200 Gb/sec (4X HDR)"


def test_shared_memory_missing():
    s = probe_comm.probe(env={}, shm=lambda: "/dev/shm is missing or not writable", ib=lambda: None, rdma=lambda: [])
    c = _check(s, "shared memory")
    assert c.status == "fail" and "--shm-size" in c.advice


@pytest.mark.parametrize("env, ok, text", [
    ({}, None, "none (a single process"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}, True,
     "rank 1 of 2 (local 0) from RANK/WORLD_SIZE; store at 10.0.0.1:1234"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False,
     "launch variables disagree"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, False, "outside world size"),
    ({"RANK": "0"}, False, "must be set together"),
])
def test_launcher_environment(env, ok, text):
    s = probe_comm.probe(env=env, shm=lambda: None, ib=lambda: None, rdma=lambda: [])
    c = _check(s, "launcher environment")
    assert c.status == {None: "info", True: "ok", False: "fail"}[ok] and text in c.summary
    if ok is False:
        assert "helios-run" in c.advice and not c.summary.startswith("helios.comm:")


@pytest.mark.parametrize("value", ["tcp", "verbs"])
def test_comm_backend_variable_is_checked_against_the_backends_comm_accepts(value):
    s = probe_comm.probe(env={"HELIOS_COMM_BACKEND": value}, shm=lambda: None, ib=lambda: None, rdma=lambda: [])
    c = _check(s, "HELIOS_COMM_BACKEND")
    if value in dist.BACKENDS:
        assert c.status == "ok" and c.summary == value
    else:
        assert c.status == "fail" and "'verbs' is not one of auto, shm, tcp, ibverbs" in c.summary
        assert c.advice.endswith("set it to auto, shm, tcp or ibverbs")


def test_no_cuda_driver_and_no_toolkit():
    s = probe_cuda.probe(driver=lambda: (False, "no CUDA driver on this machine (OSError: libcuda.so.1)"),
                         tool=lambda name: None)
    c = _check(s, "driver")
    assert c.status == "fail" and not c.required and c.summary.startswith("no driver")
    assert c.advice == probe_cuda.NO_DRIVER_ADVICE
    assert "pip install nvidia-cuda-nvcc" in _check(s, "ptxas").advice
    assert "pip install nvidia-cuda-nvdisasm" in _check(s, "nvdisasm").advice
    assert _check(s, "PTX ladder").status == "fail"
    assert to_json_dict([s])["ok"] is True, "no CUDA is not a reason Helios cannot run"


def test_a_gpu_is_listed_with_its_compute_capability():
    gpus = {"driver_version": "12.4", "gpus": [{"index": 0, "name": "NVIDIA H100", "sm": "sm_90", "memory": 80 << 30}]}
    s = probe_cuda.probe(driver=lambda: (True, "ok"), gpus=lambda: gpus, tool=lambda n: None, run_ladder=False)
    assert _check(s, "driver").summary == "CUDA driver 12.4, 1 GPU(s)"
    assert _check(s, "cuda:0").summary.startswith("NVIDIA H100, sm_90, 80.0 GiB")


def test_gpus_are_read_through_the_driver_api():
    from helios.cuda_ptx.emu.driver import EmulatedDriver

    class Driver(EmulatedDriver):  # the emulator lacks the two calls only the doctor makes
        def cuDriverGetVersion(self):
            return self._ok(12040)

        def cuDeviceTotalMem(self, device):
            return self._ok(80 << 30)

    got = probe_cuda.list_gpus(Driver())
    assert got == {"driver_version": "12.4", "gpus": [{"index": 0, "name": "Helios PTX emulator (sm_90a)", "sm": "sm_90",
                                                       "memory": 80 << 30}]}


def test_ptx_ladder_quick_gate_assembles_every_rung():
    ptxas = probe_cuda.find_tool("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas (pip install nvidia-cuda-nvcc)")
    rows = probe_cuda.ladder_quick_gate(ptxas)
    from helios.cuda_ptx import gate

    assert [r["rung"] for r in rows] == list(gate.gate_configs())
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["target"] for r in rows} >= {"sm_80", "sm_90a"}
    bad = probe_cuda.ladder_quick_gate("/bin/false")  # a ptxas that rejects everything
    assert not any(r["ok"] for r in bad) and bad[0]["problem"].startswith("ptxas rejected it")


def test_kernel_status_finds_stale_missing_and_corrupt_spirv(tmp_path):
    class Registry:
        PACKAGED_SPV = str(tmp_path / "spv")

        @staticmethod
        def cache_dir():
            return str(tmp_path / "cache")

    class Builder:
        @staticmethod
        def kernel_names():
            return ["k"]

        @staticmethod
        def kernel_variants(name):
            return {"good": [], "old": [], "gone": [], "junk": [], "fixed": []}

        @staticmethod
        def source_mtime(name):
            return 1000.0

    (tmp_path / "spv").mkdir()
    (tmp_path / "cache" / "spv").mkdir(parents=True)
    for name, mtime, body, where in [("good", 2000, probe_kernels.SPIRV_MAGIC, "spv"), ("old", 500, probe_kernels.SPIRV_MAGIC, "spv"),
                                     ("junk", 2000, b"\0\0\0\0", "spv"), ("fixed", 500, probe_kernels.SPIRV_MAGIC, "spv"),
                                     ("fixed", 2000, probe_kernels.SPIRV_MAGIC, "cache/spv")]:
        p = tmp_path / where / f"k.{name}.spv"
        p.write_bytes(body)
        os.utime(p, (mtime, mtime))
    st = probe_kernels.kernel_status(Registry, Builder)
    assert st == {"current": ["k.good"], "rebuilt": ["k.fixed"], "stale": ["k.old"], "missing": ["k.gone"], "corrupt": ["k.junk"]}


def test_the_pipeline_cache_line_says_when_the_driver_saves_nothing_and_names_leftovers(tmp_path):
    """A blob of the 32-byte header alone (what lavapipe saves) holds no pipelines; a temporary file of a
    save that never finished is named, not counted as a blob."""
    uuid = "76616c2d257300000000000000000000"
    (tmp_path / f"pipeline_cache_{uuid}.bin").write_bytes(b"\0" * probe_kernels.VK_CACHE_HEADER_BYTES)
    (tmp_path / f"pipeline_cache_{uuid}.bin.tmp.4242").write_bytes(b"\0" * 32)
    pc = probe_kernels.pipeline_cache(str(tmp_path))
    assert pc == {"path": str(tmp_path), "files": 1, "bytes": 32, "header_only": 1,
                  "leftovers": [f"pipeline_cache_{uuid}.bin.tmp.4242"]}
    text = probe_kernels.pipeline_cache_text(pc)
    assert "1 blob(s), 32 B holding no pipelines: the driver saves only the blob's header" in text
    assert f"1 temporary file(s) of a save that never finished (pipeline_cache_{uuid}.bin.tmp.4242" in text
    (tmp_path / f"pipeline_cache_{uuid}.bin").write_bytes(b"\0" * 4096)  # a driver that caches pipelines
    (tmp_path / f"pipeline_cache_{uuid}.bin.tmp.4242").unlink()
    text = probe_kernels.pipeline_cache_text(probe_kernels.pipeline_cache(str(tmp_path)))
    assert text.endswith("1 blob(s), 4.0 KiB (VkPipelineCache per device, keyed by pipelineCacheUUID)"), text
    assert probe_kernels.pipeline_cache(str(tmp_path / "none"))["files"] == 0


def test_mesa_shader_cache_location(tmp_path):
    assert probe_kernels.mesa_shader_cache({"MESA_SHADER_CACHE_DISABLE": "true"})[0] is None
    assert probe_kernels.mesa_shader_cache({"MESA_SHADER_CACHE_DIR": "/x"}) == ("/x", "MESA_SHADER_CACHE_DIR")
    (tmp_path / "mesa_shader_cache").mkdir()
    assert probe_kernels.mesa_shader_cache({"XDG_CACHE_HOME": str(tmp_path)})[0] == str(tmp_path / "mesa_shader_cache")


def test_a_crashing_probe_is_a_finding_not_a_traceback(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("simulated probe bug")

    monkeypatch.setitem(cli.SECTIONS, "comm", ("Communication", boom))
    assert cli.main(["--section", "comm", "--no-color"]) == 0  # an optional section: Helios can still run
    out = capsys.readouterr().out
    assert "✗ probe: the comm probe failed: RuntimeError: simulated probe bug" in out
    assert "-> report it with the output of helios-doctor --json" in out


def test_text_rendering_of_a_required_failure():
    s = Section("x", "X")
    s.ok("a", "fine")
    s.fail("b", "broken", "do this", required=True)
    s.info("c", "a fact")
    text = to_text([s])
    assert text.splitlines()[:5] == ["✗ X", "  ✓ a: fine", "  ✗ b: broken", "      -> do this", "  · c: a fact"]
    assert "1 required check(s) failed" in text
    with pytest.raises(ValueError):
        s.checks.append(type(s.checks[0])("d", "maybe", "?"))


def test_cooperative_matrix_line_lists_the_shapes_and_whether_they_are_used():
    from helios._kernels import coopmat

    rows = [dict(m=16, n=16, k=16, a="f16", b="f16", c="f32", result="f32", scope="subgroup", saturating=False),
            dict(m=16, n=8, k=32, a="i8", b="i8", c="i32", result="i32", scope="subgroup", saturating=False)]
    gpu = dict(LAVAPIPE, type="discrete", cooperative_matrix=rows,
               limits=dict(LAVAPIPE["limits"], subgroup_size=32, max_shared_memory=49152))
    text = probe_vulkan.coopmat_text(gpu, None)
    assert text.startswith("16x16x16 f16*f16+f32 (subgroup), 16x8x32 i8*i8+i32 (subgroup) -- ")
    assert ("float16: used (128x128x32 tiles" in text) == coopmat.kernel_built(), text
    assert "bfloat16: not used (no subgroup-scope bf16*bf16+f32 shape (fp32 sums) among those listed" in text
    bf16 = dict(gpu, cooperative_matrix=rows + [dict(rows[0], a="bf16", b="bf16")])
    assert ("bfloat16: used (128x128x32 tiles" in probe_vulkan.coopmat_text(bf16, None)) == coopmat.kernel_built()
    assert "bfloat16 flash attention: not used (no subgroup-scope 16x16x16 bf16*bf16+f32" in text
    assert ("bfloat16 flash attention: used (4 subgroups" in probe_vulkan.coopmat_text(bf16, None)) == \
        coopmat.kernel_built(coopmat.FLASH_KERNEL)
    assert ("float16 flash attention: used (4 subgroups x 16 rows, 32-row tiles forward)" in text) == \
        coopmat.kernel_built(coopmat.FLASH_KERNEL), text
    assert probe_vulkan.coopmat_text(LAVAPIPE, EXTRA).startswith("none listed (not used")
    nv_only = dict(EXTRA, cooperative_matrix_nv=True, cooperative_matrix_shapes=["16x8x16 f16*f16+f32"])
    assert "the driver has it (16x8x16 f16*f16+f32), but not used" in probe_vulkan.coopmat_text(LAVAPIPE, nv_only)
