"""Writing a file so that a crash leaves the old content or the new, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import IO, Any

Content = str | bytes | Callable[[IO[Any]], None]
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_boot_id(path: str = BOOT_ID_PATH) -> str:
    """This machine's boot id (the kernel's); "unknown" where it cannot be read."""
    try:
        with open(path) as fh:
            return fh.read().strip() or "unknown"
    except OSError:
        return "unknown"


def write_atomically(path: str, content: Content, mode: int | None = None, *, prefix: str = ".tmp-",
                     durable: bool = True) -> None:
    """Write ``content`` (text, bytes, or a function that writes to the open file) to a temporary
    file beside ``path`` and rename it over ``path``. ``mode``: the file's permissions (None: 0600).
    ``durable``: fsync the file and its directory, so the rename survives a power cut. On any failure
    the temporary file is removed and ``path`` is as it was; OSError is raised as it came."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
        if durable:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
