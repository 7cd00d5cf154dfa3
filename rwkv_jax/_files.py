"""Files written so that a failed write never destroys the previous file."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat


def write_atomically(path, write) -> None:
    """``write(f)`` into a new file in ``path``'s directory, flushed to the disk, then renamed
    over ``path``: a write that fails part-way (a full disk, say) leaves any previous file at
    ``path`` whole, and no temporary file behind.

    As a plain ``open(path, "wb")`` would: a file that exists keeps its permission bits, a new
    one gets those of the umask, and a symbolic link is followed (its target is the file
    replaced; the link stays a link). ``path``: str, bytes or ``os.PathLike``."""
    path = os.path.realpath(os.fsdecode(path))
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    # os.open with mode 0o666 and the umask: a new file gets the permissions of a plain open().
    f = os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")
    try:
        with f:
            if mode is not None:
                os.chmod(temporary, mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory) -> None:
    """Make the rename itself durable (POSIX; directories cannot be opened on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
