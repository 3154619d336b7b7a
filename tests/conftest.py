"""Shared pytest setup: markers and the skip rules of each test tier."""

import os
import shutil

import pytest


def _nvidia_gpu_present() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None and os.system("nvidia-smi -L >/dev/null 2>&1") == 0


def pytest_collection_modifyitems(config, items):
    if not _nvidia_gpu_present():
        skip_gpu = pytest.mark.skip(reason="no NVIDIA GPU on this machine (gpu tier)")
        for item in items:
            if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds parameter ids too
                item.add_marker(skip_gpu)
