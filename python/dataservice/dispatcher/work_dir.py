"""Safe reads and private writes of the files a dispatcher keeps in `work_dir`.

Everything the dispatcher reads back from its `work_dir` (journal segments and
snapshots, dataset definitions, buffer files) goes through `open_regular` or
`read_verified`: a file is opened without following a symlink
(`O_NOFOLLOW`) and without blocking (`O_NONBLOCK`: a FIFO put in a file's
place would otherwise block the open for good), and `fstat` must show a
regular file before a byte is read. Any damage is a `DataLossError` naming
the file and what is wrong with it.

Everything it writes is private to its user, whatever the umask: files are
created mode 0600 and directories 0700 (`fchmod`/`chmod` after creation, as a
umask can only take bits away), and a looser mode found at start-up is
tightened (a work_dir written by an older version had 0644 files).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable

from dataservice import errors

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
_READ_CHUNK_BYTES = 1 << 22


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"


def open_regular(path: str, what: str, write: bool = False) -> int:
    """An fd of the regular file `path`, opened without following a symlink
    and without blocking; a group- or world-accessible mode is tightened to
    0600 (logged). The caller closes the fd.

    Args:
        path: The file.
        what: What the file is, for messages ("journal snapshot").
        write: Open it read-write (to truncate a torn tail), else read-only.

    Raises:
        DataLossError: It is missing, a symlink, a FIFO or anything but a
            regular file, or cannot be opened; the message names it.
    """
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as err:
        raise errors.DataLossError(f"{what} {path} is missing") from err
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise errors.DataLossError(
                f"{what} {path} is a symlink, not a regular file (a dispatcher never "
                "writes one: someone replaced the file)"
            ) from err
        raise errors.DataLossError(f"{what} {path} cannot be opened: {err}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.DataLossError(
                f"{what} {path} is {_kind(st.st_mode)}, not a regular file (a dispatcher "
                "never writes one: someone replaced the file)"
            )
        if st.st_mode & 0o077:
            log.warning(
                "%s %s has mode %o: making it %o (private to its user)",
                what,
                path,
                stat.S_IMODE(st.st_mode),
                FILE_MODE,
            )
            try:
                os.fchmod(fd, FILE_MODE)
            except OSError as err:  # another user's file: readable, so go on
                log.warning("cannot change the mode of %s: %s", path, err)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_verified(
    path: str, what: str, sha256_hex: str | None = None, size_bytes: int | None = None
) -> bytes:
    """The bytes of the regular file `path` (opened as `open_regular` does),
    checked against the size and SHA-256 that were recorded when it was written.

    Raises:
        DataLossError: It cannot be opened (see `open_regular`), holds another
            number of bytes (truncated), or its bytes have another SHA-256 (a
            flipped byte, another file); the message names it and says which.
    """
    chunks: list[bytes] = []
    _scan(path, what, sha256_hex, size_bytes, chunks.append)
    return b"".join(chunks)


def verify(path: str, what: str, sha256_hex: str, size_bytes: int) -> None:
    """Checks the file `path` as `read_verified` does, without keeping its bytes.

    Raises:
        DataLossError: As `read_verified`.
    """
    _scan(path, what, sha256_hex, size_bytes, lambda chunk: None)


def _scan(
    path: str,
    what: str,
    sha256_hex: str | None,
    size_bytes: int | None,
    sink: Callable[[bytes], None],
) -> None:
    fd = open_regular(path, what)
    digest = hashlib.sha256()
    read_bytes = 0
    try:
        size = os.fstat(fd).st_size
        if size_bytes is not None and size != size_bytes:
            raise errors.DataLossError(
                f"{what} {path} holds {size} bytes, not the {size_bytes} it was written with "
                "(truncated or replaced)"
            )
        while chunk := os.read(fd, _READ_CHUNK_BYTES):
            digest.update(chunk)
            read_bytes += len(chunk)
            sink(chunk)
    except OSError as err:
        raise errors.DataLossError(f"{what} {path} cannot be read: {err}") from err
    finally:
        os.close(fd)
    if size_bytes is not None and read_bytes != size_bytes:
        raise errors.DataLossError(f"{what} {path} changed while it was read")
    if sha256_hex is not None and digest.hexdigest() != sha256_hex:
        raise errors.DataLossError(
            f"{what} {path} is damaged: its SHA-256 is {digest.hexdigest()}, not the "
            f"{sha256_hex} recorded when it was written (a changed byte, or another "
            "file's contents)"
        )


def private_dir(path: str, what: str, strict: bool = True) -> str:
    """Makes `path` (and missing parents) a directory of mode 0700, or
    tightens the mode of the one there.

    Args:
        path: The directory.
        what: What it is, for messages ("the journal folder").
        strict: Something else at `path` (a file, a symlink) is damage
            (`DataLossError`), else an `OSError`, for a folder whose files
            the dispatcher can do without (it keeps buffers inline then).

    Raises:
        DataLossError: `strict`, and `path` is a symlink or not a directory.
        OSError: It cannot be made (a parent is a file, read-only file system),
            or, not `strict`, it is a symlink or not a directory.
    """
    try:
        os.makedirs(path, mode=DIR_MODE)
    except FileExistsError:
        pass
    except NotADirectoryError as err:  # a folder above it is a file (work_dir itself?)
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        mode = os.lstat(parent).st_mode
        kind = "a file" if stat.S_ISREG(mode) else _kind(mode)
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{what} {path} cannot be made: {parent} is {kind}, not a directory "
            "(is work_dir / --work-dir a file?)",
        ) from err
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        message = (
            f"{what} {path} is {_kind(st.st_mode)}, not a directory (a dispatcher never "
            "makes one: someone replaced it)"
        )
        if strict:
            raise errors.DataLossError(message)
        raise NotADirectoryError(errno.ENOTDIR, message)
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def create_private(path: str) -> int:
    """A new file at `path` (never an existing one: O_EXCL, no symlink
    followed), mode 0600 whatever the umask, opened for writing. The caller
    closes the fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: str) -> None:
    """Makes a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, durable: bool = True, concurrent: bool = False) -> None:
    """Writes `data` to `path` (mode 0600): to `path.tmp` first, fsynced when
    `durable`, then renamed over `path`, so `path` is whole or absent. With
    `concurrent`, other threads may write the same `path` at once (with the
    same bytes: a file named by its digest): each writes its own
    `path.XXXXXXXX.tmp` (a torn one is the caller's to delete)."""
    if concurrent:
        fd, tmp = tempfile.mkstemp(
            dir=os.path.dirname(path) or ".", prefix=os.path.basename(path) + ".", suffix=".tmp"
        )
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    else:
        tmp = path + ".tmp"
        try:
            os.unlink(tmp)  # a torn one from a crash
        except FileNotFoundError:
            pass
        fd = create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")
