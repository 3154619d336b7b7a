"""helios.profile: step timers, MFU/HFU, Chrome traces, the SQLite run database, the HTML report.

Nothing here imports the device runtime: the runtime calls in (see
:mod:`helios.profile.profiler` for the contract).
"""

if __name__ == "profile":  # pragma: no cover - depends on how Python was started
    # This folder was imported as the bare top-level module ``profile``: the checkout's root
    # is on sys.path (``python -m ...`` run from it) and shadows the standard library's
    # ``profile``, which cProfile (and so PyTorch) imports.  Stand aside: load the standard
    # module under its own name and become it.  Helios itself always imports helios.profile.
    import importlib.util as _ilu
    import os as _os
    import sys as _sys
    import sysconfig as _sysconfig

    _spec = _ilu.spec_from_file_location("profile", _os.path.join(_sysconfig.get_paths()["stdlib"], "profile.py"))
    _std = _ilu.module_from_spec(_spec)
    _sys.modules["profile"] = _std
    _spec.loader.exec_module(_std)
    globals().update({k: v for k, v in vars(_std).items() if k not in ("__name__", "__spec__", "__loader__")})
else:
    from helios.profile.debug import debug_level, format_kernel_line, log_kernel
    from helios.profile.errors import ProfileError
    from helios.profile.events import DeviceEvent, HostOpRecord, MemorySample, SubmitRecord
    from helios.profile.mfu import (
        PEAK_TABLE,
        PeakFlops,
        compute_mfu,
        cpu_peak_estimate,
        format_mfu,
        gpt_flops_per_token,
        gpt_hardware_flops_per_token,
        peak_flops,
    )
    from helios.profile.profiler import (
        Collector,
        KeyAverages,
        OpAverage,
        Profiler,
        current_collector,
        key_averages,
        parse_profile_steps,
        profile,
        register_runtime_hooks,
        unregister_runtime_hooks,
    )
    from helios.profile.rundb import DB_FILENAME, RunDB, read_run
    from helios.profile.timers import ALL_PHASES, IDLE, PHASES, PhaseSpan, StepRecord, StepTimer
    from helios.profile.trace import build_trace, validate_trace, write_trace

    __all__ = [
        "ALL_PHASES",
        "DB_FILENAME",
        "IDLE",
        "PEAK_TABLE",
        "PHASES",
        "Collector",
        "DeviceEvent",
        "HostOpRecord",
        "KeyAverages",
        "MemorySample",
        "OpAverage",
        "PeakFlops",
        "PhaseSpan",
        "ProfileError",
        "Profiler",
        "RunDB",
        "StepRecord",
        "StepTimer",
        "SubmitRecord",
        "build_trace",
        "compute_mfu",
        "cpu_peak_estimate",
        "current_collector",
        "debug_level",
        "format_kernel_line",
        "format_mfu",
        "gpt_flops_per_token",
        "gpt_hardware_flops_per_token",
        "key_averages",
        "log_kernel",
        "parse_profile_steps",
        "peak_flops",
        "profile",
        "read_run",
        "register_runtime_hooks",
        "unregister_runtime_hooks",
        "validate_trace",
        "write_trace",
    ]
