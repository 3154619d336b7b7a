"""The profiler's one error type, rooted in the project hierarchy (``helios.errors``)."""

from helios.errors import HeliosError


class ProfileError(HeliosError, ValueError):
    """Wrong use of a profiling API: unknown phase, unbalanced step, bad sort key, bad run folder.

    A ``ValueError`` too, so ``except ValueError`` keeps working.
    """
