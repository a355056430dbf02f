"""Files replaced atomically: readers see the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int, sync_directory: bool = False) -> None:
    """Replace `path` with `data` so that readers see the old file or the new one, never a part.

    Writes a temporary file in the same directory (created if missing),
    fsyncs it and renames it over `path`; with `sync_directory` the rename
    itself is made durable too. Raises OSError, leaving the old file and no
    temporary behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fchmod(tmp.fileno(), mode)
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # The rename did not happen: the temporary must not linger beside the real file.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    if sync_directory:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
