"""What a part of the training checkpoint is (train/parts.py lists them): the `Part` protocol, the loaded
`Checkpoint` its check and load read, and `NoCheck` for the parts whose saved values can continue any run of this
config."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping, Protocol

Checkpoint = Mapping[str, Any]  # a loaded checkpoint: key -> value


class Part(Protocol):
    keys: ClassVar[tuple[str, ...]]        # the checkpoint keys this part writes
    required: ClassVar[tuple[str, ...]]    # those a complete checkpoint must hold

    def state_dict(self) -> dict[str, Any]: ...

    def check(self, ckpt: Checkpoint, where: str) -> None: ...

    def load_state_dict(self, ckpt: Checkpoint) -> None: ...


class NoCheck:
    """Mixin for parts whose every saved value can continue any run of this config."""

    def check(self, ckpt: Checkpoint, where: str) -> None:
        return None
