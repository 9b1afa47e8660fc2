"""Files in folders the workbench does not control: one atomic write, one file lock, reads that cannot hang, and
names from metadata that cannot leave their folder.

A run folder, a prepared dataset or a checkpoint may come from a colleague or a download, so:
  * writes never follow a symbolic link (`write_atomic`, `open_for_append`, `FileLock`): a link planted where
    the workbench writes is refused (`LinkError`, naming it), never written through;
  * a file opened by path is a regular file first (`open_regular`, `check_regular`): a FIFO or a device would
    block `open()` forever;
  * a file name read from metadata (an index, a manifest, checksums) is one plain name inside its folder
    (`inside`), checked before anything is opened.

Torch-free and workbench-free (errors are OSError / ValueError subclasses the callers turn into their own
one-line errors), so every layer can use it.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import stat
import threading
from pathlib import Path, PurePosixPath

FILE_MODE = 0o644  # what the workbench writes is meant to be read by others (exports, run folders)


class LinkError(OSError):
    """A symbolic link where the workbench reads or writes a file of its own: refused, never followed."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(errno.ELOOP, "is a symbolic link; the workbench does not write through links", str(path))

    def __str__(self) -> str:
        return f"{self.filename} is a symbolic link; the workbench never writes through one"


class LockUnsupportedError(OSError):
    """flock(2) failed for another reason than a holder: the file system cannot lock (Lustre without `flock`)."""


class NotRegularError(OSError):
    """A path that is not a regular file (a FIFO, a device, a socket, a folder) where a file is read."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(errno.EINVAL, f"is {what}, not a regular file", str(path))
        self.what = what

    def __str__(self) -> str:
        return f"{self.filename} is {self.what}, not a regular file"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def _open_nofollow(path: Path, flags: int) -> int:
    """os.open with O_NOFOLLOW; a link at `path` raises LinkError naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and os.path.islink(path)):
            raise LinkError(path) from None
        raise


def _check_written(fd: int, path: Path) -> None:
    """A file the workbench writes must be a regular file with one name: a FIFO would block, and a hard link
    would carry the write to another name (possibly outside the folder)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
            raise OSError(errno.EMLINK, "has other hard links; the workbench does not write through them", str(path))
        raise NotRegularError(path, _kind(st.st_mode))


def fsync_dir(folder: str | os.PathLike) -> None:
    """Makes a rename or a new file in `folder` durable (the directory entry itself is flushed)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new(path: str | os.PathLike):
    """`path` created afresh for binary writing: whatever name was there (a leftover, a planted link) is unlinked
    first, and the new file is opened with O_EXCL | O_NOFOLLOW, so nothing outside is ever written."""
    path = Path(path)
    try:
        os.unlink(path)  # the name only, never a link's target
    except FileNotFoundError:
        pass
    return os.fdopen(_open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes `data` to `path` atomically and durably: a temp file next to it (created new: O_EXCL, never a link
    followed), fsync, rename over `path` (which replaces a link there instead of writing through it), fsync of
    the folder. A reader sees the old content or the new, never a part."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # one per writer: no two collide
    f = create_new(tmp)
    try:
        with f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def open_for_append(path: str | os.PathLike):
    """A text file opened for appending (created if missing) without following a link at `path`."""
    path = Path(path)
    fd = _open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    _check_written(fd, path)
    return os.fdopen(fd, "a")


class FileLock:
    """An exclusive flock(2) on a lock file, with a one-line record of the holder in it.

    The kernel (or the file server: NFS, Lustre mounted with `flock`) releases it when the holder dies, whatever
    killed it, so a stale lock never blocks. The lock file is opened without following a link.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self, wait: bool = False) -> bool:
        """Takes the lock; False if another process holds it (with `wait`: blocks until it is free).

        Raises:
            LinkError: the lock file is a symbolic link.
            LockUnsupportedError: the file system cannot lock.
            OSError: the lock file cannot be created (a missing or read-only folder).
        """
        fd = _open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        _check_written(fd, self.path)  # (closes it when it raises)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as e:
            busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            self._busy = os.pread(fd, 4096, 0) if busy else b""
            os.close(fd)
            if busy:
                return False
            raise LockUnsupportedError(e.errno, e.strerror, str(self.path)) from None
        self.fd = fd
        return True

    def holder(self) -> bytes:
        """The record the holder wrote (this process's own once acquired; the other one's after a refusal)."""
        if self.fd is None:
            return getattr(self, "_busy", b"")
        return os.pread(self.fd, 4096, 0)

    def record(self, text: str) -> None:
        """Replaces the record with `text` (who holds the lock), durably."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)

    def release(self, clear: bool = True) -> None:
        """Clears the record (unless not `clear`) and unlocks; closing the only descriptor releases the flock."""
        if self.fd is None:
            return
        if clear:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass  # a vanished or read-only folder: the next holder sees a stale record, harmless
        os.close(self.fd)
        self.fd = None


def check_regular(path: str | os.PathLike) -> os.stat_result:
    """The stat of `path` (links followed) if it is a regular file.

    Raises:
        NotRegularError: a FIFO, device, socket or folder.
        FileNotFoundError: nothing there.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularError(path, _kind(st.st_mode))
    return st


def open_regular(path: str | os.PathLike):
    """`path` opened for binary reading, checked on the open descriptor to be a regular file: a FIFO opens without
    blocking (O_NONBLOCK) and is refused, as are devices."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularError(path, _kind(st.st_mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file (see `open_regular`)."""
    with open_regular(path) as f:
        return f.read()


def read_json(path: str | os.PathLike):
    """The JSON in a regular file.

    Raises:
        ValueError: not UTF-8 or not JSON (the message names the file and where); see `open_regular` for the rest.
    """
    raw = read_bytes(path)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start:,})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path} is not JSON the workbench reads (nested too deeply)") from None


def inside(folder: str | os.PathLike, name: str) -> Path:
    """`folder / name` for a file name read from metadata, refused unless it is one plain name in `folder`:
    not empty, not absolute, no separator, not `.` or `..`, no NUL byte.

    Raises:
        ValueError: naming the name.
    """
    if not plain_name(name):
        raise ValueError(f"{name!r} is not a file name inside {folder}")
    return Path(folder) / name


def plain_name(name) -> bool:
    """`name` is one plain file name (see `inside`)."""
    return isinstance(name, str) and bool(name) and not any(c in name for c in "\0/\\") and \
        name not in (".", "..") and not PurePosixPath(name).is_absolute()


def owner_tag() -> str:
    """host-pid-thread of this writer: the suffix of its temporary folders, so that a later writer can tell an
    abandoned one (its process is gone) from one being written (`remove_abandoned`)."""
    return f"{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"


def remove_abandoned(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Removes the folders `<parent>/<prefix><owner_tag>` whose writer was killed: of this host, its process gone.
    Those of live writers and of other hosts (whose processes cannot be asked) are left. Returns the removed."""
    removed = []
    for p in sorted(Path(parent).glob(f"{glob.escape(prefix)}*")):
        host, pid, _ = p.name[len(prefix):].rsplit("-", 2) if p.name.count("-") >= 2 else ("", "", "")
        if host != socket.gethostname() or not pid.isdigit() or p.is_symlink() or not p.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive: being written
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def find_link(folder: str | os.PathLike) -> Path | None:
    """The first symbolic link inside `folder` (its tree walked without following links), or None."""
    for root, dirs, names in os.walk(folder):
        for name in sorted(dirs + names):
            p = Path(root) / name
            if p.is_symlink():
                return p
    return None


__all__ = ["LinkError", "LockUnsupportedError", "NotRegularError", "create_new", "write_atomic", "open_for_append",
           "FileLock", "fsync_dir", "check_regular", "open_regular", "read_bytes", "read_json", "inside", "plain_name",
           "owner_tag", "remove_abandoned", "find_link"]
