"""Build of the native parts: the Vulkan addon (pybind11) and the SPIR-V kernels.

Everything else lives in pyproject.toml.  ``pip install -e .`` and ``pip install .``
both run ``build_ext``, which first compiles every GLSL kernel variant to SPIR-V
with ``glslc`` (kernels_spirv/build.py) and then builds ``helios._vulkan``.

``HELIOS_NO_NATIVE=1`` installs the pure-Python parts only (no Vulkan addon, no SPIR-V,
no shm transport) and needs nothing but setuptools: enough for ``helios.cuda_ptx`` on a
GPU machine that has neither Vulkan nor glslc (``scripts/gpu_check.sh``).
"""

import importlib.util
import os
import shutil

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_kernel_builder():
    # Loaded by path: importing the helios package here would need the addon we are building.
    spec = importlib.util.spec_from_file_location("_helios_kernel_build", os.path.join(HERE, "kernels_spirv", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _native() -> dict:
    """setup() arguments that build the SPIR-V kernels, the Vulkan addon and the shm transport."""
    from pybind11.setup_helpers import Pybind11Extension, build_ext

    class BuildExtAndKernels(build_ext):
        """build_ext that compiles the SPIR-V kernels before the C++ addon."""

        def run(self):
            src_spv = os.path.join(HERE, "kernels_spirv", "spv")
            # HELIOS_SKIP_KERNEL_BUILD=1 rebuilds only the addon (the registry compiles stale kernels at run time).
            if os.environ.get("HELIOS_SKIP_KERNEL_BUILD") != "1":
                _load_kernel_builder().compile_all(src_spv)
            os.makedirs(src_spv, exist_ok=True)
            if not self.inplace:
                dst = os.path.join(self.build_lib, "helios", "kernels_spirv", "spv")
                os.makedirs(dst, exist_ok=True)
                for name in os.listdir(src_spv):
                    shutil.copy2(os.path.join(src_spv, name), os.path.join(dst, name))
            super().run()

    native_sources = sorted(
        os.path.join("helios", "native", f) for f in os.listdir(os.path.join(HERE, "helios", "native")) if f.endswith(".cpp")
    )
    ext_modules = [
        Pybind11Extension(
            "helios._vulkan",
            native_sources,
            cxx_std=17,
            libraries=["vulkan"],
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        )
    ] if native_sources else []
    # helios.comm._shm: atomics and futex waits of the shared-memory transport (plain C, no pybind11).
    ext_modules.append(Extension("helios.comm._shm", [os.path.join("comm", "native", "shm.c")], extra_compile_args=["-O2"]))
    return {"ext_modules": ext_modules, "cmdclass": {"build_ext": BuildExtAndKernels}}


setup(**({} if os.environ.get("HELIOS_NO_NATIVE") == "1" else _native()))
