"""Random number state: a seed and a Philox counter offset, advanced per call.

Random tensors come from the device's counter-based Philox generator, so a
(seed, offset) pair fixes a tensor on any device.  The default generator's state is
two integers: checkpoints save and restore it for bit-exact resume.
"""

from __future__ import annotations


class Generator:
    """A Philox stream: each draw takes the next counter offset."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.offset = 0

    def manual_seed(self, seed: int) -> "Generator":
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = 0
        return self

    def next_offset(self) -> tuple[int, int]:
        """(seed, offset) for one draw; advances the offset."""
        off = self.offset
        self.offset += 1
        return self.seed, off

    def get_state(self) -> dict:
        return {"seed": self.seed, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self.offset = int(state["offset"])


_default = Generator(0)


def default_generator() -> Generator:
    """The generator used when no seed or generator is given."""
    return _default


def manual_seed(seed: int) -> Generator:
    """Seed the default generator (like torch.manual_seed)."""
    return _default.manual_seed(seed)


def get_rng_state() -> dict:
    return _default.get_state()


def set_rng_state(state: dict) -> None:
    _default.set_state(state)
