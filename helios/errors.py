"""The one exception hierarchy of Helios.

Every error Helios raises on purpose derives from :class:`HeliosError`, and the
more specific ones also derive from the builtin a Python user would expect
(``ShapeError`` is a ``ValueError``, ``CommError`` a ``TimeoutError``), so
``except ValueError`` keeps working.  Messages say what was expected, what came,
and what to do.
"""


class HeliosError(Exception):
    """Base class of every error Helios raises on purpose."""


class ShapeError(HeliosError, ValueError):
    """Shapes that an op cannot combine (names the op and both shapes)."""


class DTypeError(HeliosError, TypeError):
    """A dtype an op or a device does not support."""


class DeviceError(HeliosError, RuntimeError):
    """No usable device, or a device-level failure."""


class OutOfMemoryError(DeviceError, MemoryError):
    """An allocation the device cannot hold (says bytes asked and pool state)."""


class CommError(HeliosError, TimeoutError):
    """A collective failed: dead or stuck peer, deadline passed, mismatch."""


class CheckpointError(HeliosError, RuntimeError):
    """A checkpoint that is missing, corrupt or does not match the model."""


class DataError(HeliosError, ValueError):
    """A corpus or tokenizer spec the data pipeline cannot use (empty, binary, malformed spec)."""


class InPlaceError(HeliosError, RuntimeError):
    """An in-place op on a tensor that requires grad (the tape cannot record it)."""
