"""The engine's named options as types: what a string option of ``EngineConfig`` may say.

Each is a ``str`` enum, so a member equals, prints and serialises as its value (``"fill"``):
users keep passing strings, the code compares members.
"""

from __future__ import annotations

import enum
from typing import TypeVar

_C = TypeVar("_C", bound="Choice")


class Choice(str, enum.Enum):
    """A string option's values."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls: type[_C], name: str, value: object) -> _C:
        """``value`` as a member; a ValueError naming the option and its values otherwise."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


class Mode(Choice):
    RESIDENT = "resident"
    OFFLOAD = "offload"
    STREAM = "stream"
    OFFLOAD_SPEC = "offload-spec"
    SPECSTREAM = "specstream"
    PARALLEL_SPEC = "parallel-spec"


class History(Choice):
    """How host history reaches attention."""

    NONE = "none"  # it all stays on the device
    RESTORE = "restore"  # whole layers restored before attention (the next one prefetched)
    STREAM = "stream"  # chunk waves attended as they land


class Drafting(Choice):
    """Where drafting runs."""

    SEQUENTIAL = "sequential"  # after verification, same device
    GAPS = "gaps"  # in the link's gaps, same device (two groups)
    PARALLEL = "parallel"  # on a second device (two groups)


class Residency(Choice):
    FILL = "fill"
    TAIL = "tail"


class SpeculativePolicy(Choice):
    AUTO = "auto"
    FIXED = "fixed"


class HostAttentionMode(Choice):
    OFF = "off"
    AUTO = "auto"


class DraftCache(Choice):
    WINDOW = "window"
    FULL = "full"


class AttentionBackend(Choice):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


class Proposer(Choice):
    DRAFT = "draft"
    NGRAM = "ngram"
