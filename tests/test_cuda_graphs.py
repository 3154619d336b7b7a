"""Replayed steps on cuda:0 as CUDA graphs (HELIOS_CUDA_GRAPHS=1, cuda_ptx/replay_graphs.py), on
the emulated driver: the same bits as launches one by one; each run of launches goes as one graph,
AdamW's per-step push constants update their node in place; a driver that cannot build graphs
falls back with one warning."""

from __future__ import annotations

import numpy as np
import pytest

import helios as hl
import helios.nn.functional as F
from helios.backend import COPY, DISPATCH, FILL
from helios.cuda_ptx import driver, replay_graphs
from helios.nn import Parameter
from helios.optim import AdamW
from helios.runtime import close_device, get_runtime

pytestmark = pytest.mark.vulkan

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 16, 32)).astype(np.float32)  # a batch per step: captured, then 2 replays
Y = RNG.standard_normal((3, 16, 8)).astype(np.float32)
W1, B1, W2 = (RNG.standard_normal(s).astype(np.float32) * 0.2 for s in ((32, 64), (64,), (64, 8)))


def _replays(graphs: bool, monkeypatch, calls: list | None = None) -> tuple:
    """Losses and final parameters of a two-layer step captured on cuda:0 and replayed twice."""
    monkeypatch.setenv(replay_graphs.ENV, "1" if graphs else "0")
    close_device("cuda:0")  # the runtime reads the switch when it opens
    hl.set_device("cuda:0")
    drv = get_runtime().cu
    params = [Parameter(hl.tensor(a)) for a in (W1, B1, W2)]
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    x, y = hl.tensor(X[0]), hl.tensor(Y[0])

    def step():
        h = F.gelu(x @ params[0] + params[1])
        loss = ((h @ params[2] - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with hl.graph.capture(inputs=(x, y)) as g:
        loss = step()
    losses = [loss.item()]
    first = len(drv.launches)
    for k in (1, 2):
        g.replay(X[k], Y[k])
        losses.append(loss.item())
    replayed = drv.launches[first:]
    if calls is not None:
        calls += replayed
    return losses, [p.numpy() for p in params], sum(launch["graph"] for launch in replayed), len(replayed)


def test_graph_replays_equal_launches_one_by_one(emulated_cuda, monkeypatch):
    plain = _replays(False, monkeypatch)
    calls, built, updated = [], [], []
    real_build, real_update = replay_graphs.RunGraphs._build, None

    def build(self, launches):
        built.append(len(launches))
        return real_build(self, launches)

    monkeypatch.setattr(replay_graphs.RunGraphs, "_build", build)
    from helios.cuda_ptx.emu import driver as emu

    real_update = emu.EmulatedDriver.cuGraphExecKernelNodeSetParams
    monkeypatch.setattr(emu.EmulatedDriver, "cuGraphExecKernelNodeSetParams",
                        lambda self, *a: updated.append(1) or real_update(self, *a))
    graphed = _replays(True, monkeypatch, calls)
    # each run built once, on the first replay; the second only set AdamW's new step in its node
    assert len(built) >= 1 and sum(built) == graphed[3] // 2 and updated == [1], (built, updated)
    assert plain[0] == graphed[0]  # the losses, bit for bit
    for a, b in zip(plain[1], graphed[1]):
        assert a.tobytes() == b.tobytes()
    assert plain[2] == 0 and plain[3] == graphed[3]  # as many kernels ran either way
    assert graphed[2] == graphed[3], calls  # every replayed launch ran inside a graph here


def test_a_driver_without_graphs_falls_back_once(emulated_cuda, monkeypatch):
    plain = _replays(False, monkeypatch)
    from helios.cuda_ptx.emu import driver as emu

    def refuse(self, flags):
        return self._fail(emu._DriverError("NOT_SUPPORTED", "no graphs here"), None)

    monkeypatch.setattr(emu.EmulatedDriver, "cuGraphCreate", refuse)
    with pytest.warns(RuntimeWarning, match="cannot run as a CUDA graph"):
        fallback = _replays(True, monkeypatch)
    assert fallback[0] == plain[0] and fallback[2] == 0


def _prepared_launches() -> tuple:
    """(runtime, a captured two-kernel graph, its dispatches' prepared launches) on cuda:0."""
    hl.set_device("cuda:0")
    rt = get_runtime()
    x = hl.tensor(np.ones(64, np.float32))
    with hl.graph.capture() as g:
        (x * 2.0).exp()
    launches = [rt._prepare_launch(*args) for kind, args in g.ops if kind == DISPATCH]
    assert launches
    return rt, g, launches


def test_a_node_of_a_destroyed_graph_cannot_be_updated(emulated_cuda):
    # what RunGraphs keeps its graphs alive for: the emulated driver refuses, as the driver documents
    rt, g, launches = _prepared_launches()
    graphs = replay_graphs.RunGraphs(rt.cu, rt._check)
    graph_exec, nodes, graph = graphs._build(launches * 2)
    assert rt.cu.cuGraphDestroy(graph)[0] == rt.cu.CUresult.CUDA_SUCCESS
    res = rt.cu.cuGraphExecKernelNodeSetParams(graph_exec, nodes[0], graphs._node(launches[0]))
    assert res[0] == rt.cu.CUresult.CUDA_ERROR_INVALID_HANDLE
    rt.cu.cuGraphExecDestroy(graph_exec)
    g.release()


def test_a_run_whose_launch_count_changed_is_built_again(emulated_cuda):
    # a replaced command may launch more or fewer kernels (a flash backward without dQ): the run's
    # graph then has the wrong nodes, and is rebuilt rather than updated
    rt, g, launches = _prepared_launches()
    graphs = replay_graphs.RunGraphs(rt.cu, rt._check)
    first = len(rt.cu.launches)
    assert graphs.launch(0, launches * 3, [])
    old = graphs.execs[0]
    assert graphs.launch(0, launches * 2, [0])
    assert graphs.execs[0] is not old and len(graphs.execs[0][1]) == 2 * len(launches)
    assert len(rt.cu.launches) - first == 5 * len(launches)
    graphs.release()
    g.release()


def test_an_open_device_switches_between_graphs_and_launches(emulated_cuda, monkeypatch):
    # what bench/train_step.py --cuda-graphs-ab does: the same captured step, replayed both ways
    monkeypatch.setenv(replay_graphs.ENV, "0")
    hl.set_device("cuda:0")
    rt = get_runtime()
    x = hl.tensor(np.linspace(-1, 1, 256, dtype=np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        y = ((x * 1.5 + 0.25).tanh() * x).exp()
        z = y.sum()
    outs = []
    for on in (False, True, False):
        rt.use_cuda_graphs(on)
        first = len(rt.cu.launches)
        g.replay(X[1, 0, :8].repeat(32))
        outs.append((y.numpy().tobytes(), z.item(), sum(launch["graph"] for launch in rt.cu.launches[first:])))
    assert outs[0][:2] == outs[1][:2] == outs[2][:2]
    assert outs[0][2] == outs[2][2] == 0 and outs[1][2] >= 2
    g.release()


@pytest.mark.skipif(driver.driver_status()[0], reason="a CUDA driver is present: the real calls would run")
def test_every_graph_call_fits_the_real_bindings(emulated_cuda, monkeypatch):
    # each graph call's arguments go to the real cuda.bindings first (which convert them, then find
    # no driver library): an argument they would refuse on a GPU machine fails here
    from test_cuda_ptx_emu_driver import _BindingsProbe

    monkeypatch.setenv(replay_graphs.ENV, "1")
    close_device("cuda:0")
    hl.set_device("cuda:0")
    rt = get_runtime()
    probe = _BindingsProbe(rt.cu)
    monkeypatch.setattr(rt, "cu", probe)
    w = Parameter(hl.tensor(W2))
    opt = AdamW([w], lr=1e-2)
    x = hl.tensor(X[0, :, :8] @ np.ones((8, 64), np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        ((x @ w).tanh() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for k in (1, 2):  # built, then AdamW's node updated in place
        g.replay(X[k, :, :8] @ np.ones((8, 64), np.float32))
    assert probe.probed >= {"cuGraphCreate", "cuGraphAddKernelNode", "cuGraphInstantiate", "cuGraphLaunch",
                            "cuGraphExecKernelNodeSetParams"}, probe.probed
    g.release()


def test_tensor_core_products_and_attention_are_nodes_of_the_graphs(emulated_cuda, monkeypatch):
    # the wgmma products and flash passes of a replayed bf16 step are prepared launches like the
    # dispatches, so they sit inside the graphs instead of cutting the runs of launches apart: a bf16
    # autocast attention block (forward and backward) captured once, replayed without then with graphs
    monkeypatch.setenv(replay_graphs.ENV, "0")
    hl.set_device("cuda:0")
    rt = get_runtime()
    rng = np.random.default_rng(3)
    B, T, H, D = 1, 64, 1, 64
    C = H * D
    params = [Parameter(hl.tensor(rng.standard_normal(s).astype(np.float32) * 0.1)) for s in ((C, 3 * C), (C, C))]
    x = hl.tensor(rng.standard_normal((B, T, C)).astype(np.float32))
    with hl.graph.capture(inputs=(x,)) as g:
        with hl.amp.autocast(dtype=hl.bfloat16):
            qkv = (x @ params[0]).reshape(B, T, 3, H, D)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            y = o @ params[1]
        loss = (y.float() ** 2).mean()
        loss.backward()
    new_x = rng.standard_normal((B, T, C)).astype(np.float32)
    runs = []
    for on in (False, True):  # the same replay, one launch at a time, then as graphs
        rt.use_cuda_graphs(on)
        first = len(rt.cu.launches)
        g.replay(new_x)
        runs.append(([t.numpy().tobytes() for t in (loss, *(p.grad for p in params))],
                     [(launch["kernel"], launch["graph"]) for launch in rt.cu.launches[first:]]))
    (plain, plain_launches), (graphed, launches) = runs
    assert plain == graphed  # the loss and the gradients, bit for bit
    assert [n for n, _ in launches] == [n for n, _ in plain_launches]  # the same kernels, in the same order
    assert not any(inside for _, inside in plain_launches)
    tensor_cores = [(name, inside) for name, inside in launches if "wgmma" in name]
    assert all(inside for _, inside in tensor_cores), tensor_cores
    for kind in ("gemm_wgmma", "flash_wgmma_fwd", "flash_wgmma_dq", "flash_wgmma_dkv"):  # each kind ran, in a graph
        assert any(kind in name for name, _ in tensor_cores), (kind, launches)
    # outside the graphs: the runs of one launch only (a lone dispatch between copies or fills)
    kinds = "".join("|" if kind in (COPY, FILL) else str(kind) for kind, _ in g.ops).split("|")
    assert sum(not inside for _, inside in launches) == sum(run == str(DISPATCH) for run in kinds), launches
    g.release()
