"""The CUDA device (``cuda:N``) on the emulated driver: the Vulkan kernels translated to PTX run
Helios' op suite, and the nano GPT trains on it with the Vulkan device's losses.

No GPU is needed: ``HELIOS_CUDA_DEVICE=emulator`` makes the driver the PTX emulator, which runs
the very PTX text a GPU would be given.  Its rates mean nothing; its numbers are exact."""

import os
import subprocess
import sys

import numpy as np
import pytest

import helios as hl
from helios.nn import GPT, GPTConfig
from helios.optim import AdamW
from helios.runtime import close_device, get_runtime, set_device

pytestmark = pytest.mark.vulkan
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # one of the longest single-process tests: full runs only, not the inner loop
def test_op_suite_on_the_emulated_cuda_device():
    # Every op test of tests/test_ops.py (forward and backward against PyTorch, odd shapes,
    # broadcasting, strided views, float32/float16/bfloat16) with cuda:0 as the device.
    env = dict(os.environ, HELIOS_CUDA_DEVICE="emulator", HELIOS_DEVICE="cuda:0")
    pytest_bin = os.path.join(os.path.dirname(sys.executable), "pytest")
    r = subprocess.run([pytest_bin, "-q", "-p", "no:cacheprovider", "-x", os.path.join(REPO, "tests", "test_ops.py")],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


def _nano_losses(device: str, steps: int = 3, batch: int = 8) -> list[float]:
    set_device(device)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    hl.manual_seed(0)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = np.random.default_rng(1).integers(0, 64, (steps, batch, 33))
    losses = []
    for s in range(steps):
        x, y = hl.tensor(data[s, :, :-1]), hl.tensor(data[s, :, 1:])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        hl.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # one of the longest single-process tests: full runs only, not the inner loop
def test_nano_gpt_trains_on_emulated_cuda_as_on_vulkan(emulated_cuda):
    # 2 steps of 4 sequences: the emulator runs ~3 s a step; the second step already reads AdamW's update
    vulkan = _nano_losses(get_runtime().name, steps=2, batch=4)
    cuda = _nano_losses("cuda:0", steps=2, batch=4)
    assert get_runtime().name == "cuda:0"
    np.testing.assert_allclose(cuda, vulkan, rtol=1e-5)
    assert cuda[-1] < cuda[0]  # it learns


def test_cuda_tensors_refuse_a_vulkan_operand(emulated_cuda):
    set_device("cuda:0")
    a = hl.ones(4)
    b = hl.ones(4).to("cuda:0")
    assert (a + b).numpy().tolist() == [2.0] * 4
    vulkans = [d.name for d in hl.devices() if d.name.startswith("vulkan")]
    if not vulkans:
        pytest.skip("no Vulkan device here")
    v = hl.ones(4).to(vulkans[0])
    with pytest.raises(ValueError, match=r"different devices \(cuda:0 and vulkan:0\)"):
        a + v


@pytest.mark.gpu
def test_nano_gpt_on_a_real_gpu_is_deterministic_and_matches_vulkan(monkeypatch):
    # On the GPU itself: two runs give the same bits (no atomics anywhere: --resume stays exact),
    # and the losses are the Vulkan device's where one exists.
    monkeypatch.delenv("HELIOS_CUDA_DEVICE", raising=False)
    before = get_runtime().name
    close_device("cuda:0")
    try:
        first, second = _nano_losses("cuda:0"), _nano_losses("cuda:0")
        assert first == second
        vulkans = [d.name for d in hl.devices() if d.name.startswith("vulkan")]
        if vulkans:
            np.testing.assert_allclose(first, _nano_losses(vulkans[0]), rtol=1e-5)
    finally:
        set_device(before)
        close_device("cuda:0")


def _ddp_losses(out, *device) -> list[float]:
    """Two data-parallel ranks (helios-run) of the nano GPT for 2 steps; rank 0's per-step losses.
    (One validation batch, not 8: the final evaluation still runs on the device, at an eighth of the
    forwards; only the training losses are compared.)"""
    import sqlite3

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(LP_NUM_THREADS="1", HELIOS_CUDA_DEVICE="emulator")
    cmd = [os.path.join(os.path.dirname(sys.executable), "helios-run"), "--nproc-per-node", "2", "-m", "helios.train",
           *device, "--config", "nano", "--steps", "2", "--batch-size", "4", "--block-size", "16", "--eval-every", "0",
           "--sample-tokens", "0", "--ckpt-every", "0", "--eval-batches", "1", "--no-progress", "--out", str(out)]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    con = sqlite3.connect(os.path.join(out, "run.db"))
    try:
        return [row[0] for row in con.execute("SELECT loss FROM step_timing WHERE rank = 0 ORDER BY step")]
    finally:
        con.close()


@pytest.mark.multiproc
def test_data_parallel_on_emulated_cuda_equals_vulkan(tmp_path):
    # The gradient all-reduce reads and writes cuda:0 tensors through the device contract
    # (no mapped memory there): two ranks on cuda:0 give vulkan:0's two-rank losses.
    cuda = _ddp_losses(tmp_path / "cuda", "--device", "cuda:0")
    vulkan = _ddp_losses(tmp_path / "vulkan")
    assert len(cuda) == len(vulkan) == 2
    np.testing.assert_allclose(cuda, vulkan, rtol=1e-5)


def test_devices_lists_cuda_where_vulkan_is_missing(monkeypatch):
    # A GPU machine with the package installed without its Vulkan parts: devices() lists the
    # CUDA devices instead of failing on the missing addon (seen on such a machine).
    from helios import backends, runtime
    from helios.errors import DeviceError

    def no_addon():
        raise DeviceError("cannot load the Vulkan addon helios._vulkan (test)")

    monkeypatch.setattr(runtime, "_addon", no_addon)
    monkeypatch.setenv("HELIOS_CUDA_DEVICE", "emulator")
    assert [d.name for d in hl.devices()] == ["cuda:0"]
    cuda = backends.backend("cuda")
    monkeypatch.setitem(backends._BACKENDS, "cuda", backends.Backend("cuda", cuda.open, lambda: []))
    with pytest.raises(DeviceError, match="Vulkan addon"):
        hl.devices()
