"""Helios: a deep-learning compute stack written from scratch."""

from helios.errors import (  # noqa: F401
    CheckpointError,
    CommError,
    DeviceError,
    DTypeError,
    HeliosError,
    OutOfMemoryError,
    ShapeError,
)

__version__ = "0.1.0"
