"""CUDA graphs for replayed steps (the default on ``cuda:N``; ``HELIOS_CUDA_GRAPHS=0`` turns them off).

A replayed step (``hl.graph``) is a command list that ``CudaRuntime.run_commands`` issues with
launches prepared once (each kernel's parameter block kept: a dispatch's, a tensor-core product's,
a flash pass's): one ``cuLaunchKernel`` from Python per launch, 5-7 us of host time each on an
H200.  With graphs (the default) each run of consecutive kernel commands that holds two or
more launches becomes a CUDA graph instead, built from the prepared launches (a chain of kernel
nodes, each depending on the one before, as the stream orders them), instantiated on the first
replay and then issued with one ``cuGraphLaunch`` a run on the default stream; the copies and
fills between runs are issued as before, so the order on the stream is the list's.

The driver copies a node's parameter values when the node is added; the prepared blocks hold the
replay's fixed addresses, so a graph stays valid across replays.  A command the replay rewrote (a
dynamic push constant: AdamW's step, every replay) has its node's parameters set again in the
executable graph (``cuGraphExecKernelNodeSetParams``), not the graph rebuilt.  A driver that cannot build a graph
(an error from ``cuGraphCreate``, ``cuGraphAddKernelNode`` or ``cuGraphInstantiate``) turns
graphs off for the runtime with one warning, and the launches go one by one.

Graphs are the default because they measured faster on an H200 (``bench/train_step.py
--cuda-graphs-ab``, 2026-11-30, six runs): the small config's bf16 step 1.15x the prepared
launches (twice), GPT-2's 1.03-1.05x (four times), with host time to issue a replayed GPT-2
step 1.4-1.8 ms instead of 4.9-7.8.  ``HELIOS_CUDA_GRAPHS=0`` issues the prepared launches.
"""

from __future__ import annotations

import os

from helios.errors import DeviceError

ENV = "HELIOS_CUDA_GRAPHS"


def enabled() -> bool:
    """Whether replays run their runs of launches as CUDA graphs: yes unless ``HELIOS_CUDA_GRAPHS=0``."""
    return os.environ.get(ENV, "1").strip() != "0"


class RunGraphs:
    """The instantiated graphs of one command list's runs of launches, by the run's first index."""

    def __init__(self, cu, check) -> None:
        self.cu, self.check = cu, check
        # start -> (executable graph, its kernel nodes in order, the graph they are nodes of: kept while
        # the executable one lives, as updating a node's parameters needs the node)
        self.execs: dict[int, tuple] = {}

    def launch(self, start: int, launches: list, changed: list[int]) -> bool:
        """Issue the run starting at command ``start`` (its prepared launches) as one graph: built
        first if it is new, or with the nodes at positions ``changed`` given their new launches.
        False where the driver could not build it (nothing issued)."""
        built = self.execs.get(start)
        if built is not None and len(built[1]) != len(launches):  # a replaced command launches more or fewer kernels
            self.drop(start)
            built = None
        if built is not None and changed:
            try:
                for k in changed:
                    self.check("cuGraphExecKernelNodeSetParams",
                               self.cu.cuGraphExecKernelNodeSetParams(built[0], built[1][k], self._node(launches[k])))
            except DeviceError:  # an update the driver refuses: build the run again
                self.drop(start)
                built = None
        if built is None:
            try:
                built = self.execs[start] = self._build(launches)
            except DeviceError:
                return False
        self.check("cuGraphLaunch", self.cu.cuGraphLaunch(built[0], 0))
        return True

    def _node(self, launch: tuple):
        """The kernel node parameters of one prepared ``cuLaunchKernel`` argument tuple."""
        handle, gx, gy, gz, bx, by, bz, shared, params, _keep = launch
        node = self.cu.CUDA_KERNEL_NODE_PARAMS()
        node.func = handle
        node.gridDimX, node.gridDimY, node.gridDimZ = gx, gy, gz
        node.blockDimX, node.blockDimY, node.blockDimZ = bx, by, bz
        node.sharedMemBytes = shared
        node.kernelParams = params
        return node

    def _build(self, launches: list) -> tuple:
        """(executable graph, kernel nodes, graph) of ``launches`` in order, each node after the one before."""
        cu, check = self.cu, self.check
        graph = check("cuGraphCreate", cu.cuGraphCreate(0))
        try:
            nodes: list = []
            for launch in launches:
                deps = nodes[-1:] or None
                nodes.append(check("cuGraphAddKernelNode", cu.cuGraphAddKernelNode(graph, deps, len(nodes[-1:]),
                                                                                   self._node(launch))))
            return check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0)), nodes, graph
        except DeviceError:
            check("cuGraphDestroy", cu.cuGraphDestroy(graph))
            raise

    def drop(self, start: int) -> None:
        """Destroy the graph of the run at ``start`` (if built)."""
        built = self.execs.pop(start, None)
        if built is not None:
            self.check("cuGraphExecDestroy", self.cu.cuGraphExecDestroy(built[0]))
            self.check("cuGraphDestroy", self.cu.cuGraphDestroy(built[2]))

    def release(self) -> None:
        """Destroy every graph (the command list is forgotten, or its runs moved)."""
        for start in list(self.execs):
            self.drop(start)
