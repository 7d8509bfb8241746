"""A malicious pickle for tests of code that reads bytes from the network."""

from __future__ import annotations

from pathlib import Path


class Exploit:
    """Loaded by a general unpickler (Horovod's codec is cloudpickle), it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))
