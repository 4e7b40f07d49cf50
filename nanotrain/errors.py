"""
The errors a script reports as one line instead of a traceback: UserError (bad input: a flag, a file, a setting) and
the operating system's errors on the script's own paths (a full disk, a read-only file system, no permission, a file
where a directory belongs), with the line that names the path and says what to do; and replacing, a file written
through a temp file whose errors name the file itself. The ground floor: this module imports nothing of nanotrain.
nanotrain.common.run_script turns them into `error: ...` and an exit code.
"""

import contextlib
import errno
import os
import stat


class UserError(Exception):
    """Bad input from the user (a flag, a file, a setting). Scripts print it as one line and exit non-zero."""


# the errnos of an OSError that a script reports as one line naming the path: the user's environment, not a bug (a
# full disk or quota, a read-only file system, no permission, a file where a directory belongs or the reverse)
OS_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR,
             errno.EISDIR}
DEFAULT_BASE_DIR = os.path.join("~", ".cache", "nanotrain")  # expanded by get_base_dir


def base_dir_setting():
    """The base directory get_base_dir would use (absolute), without creating it."""
    return os.path.abspath(os.environ.get("NANOTRAIN_BASE_DIR") or os.path.expanduser(DEFAULT_BASE_DIR))


def path_kind(path):
    """What is at `path`, in words: "a directory", "a regular file", "a symbolic link", "something else" or
    "nothing" (absent)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "nothing"
    return ("a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else "something else")


def _first_non_directory(path):
    """The first of `path`'s ancestors (or `path` itself) that exists and is not a directory; None if none is."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if os.path.lexists(prefix) and not os.path.isdir(prefix):
            return prefix
    return None


def os_error_line(exc, trains=False):
    """
    The one line (str, without the "error: " prefix) a script prints for the OSError `exc` when its errno is one of
    OS_ERRNOS: the path (exc.filename; exc.filename2, a rename's target, when that is the path of the wrong kind),
    the system's reason and what to do: free space (then --resume=True when `trains`, the script trains and saves
    checkpoints), point NANOTRAIN_BASE_DIR at a writable directory or fix the permissions, move away the file or
    directory of the wrong kind. Returns None for any other exception or errno (its traceback is kept).
    """
    if not isinstance(exc, OSError) or exc.errno not in OS_ERRNOS:
        return None
    code = exc.errno
    src = os.fsdecode(exc.filename) if exc.filename is not None else None
    dst = os.fsdecode(exc.filename2) if exc.filename2 is not None else None
    if dst is not None and code in (errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
        where = path = dst
    else:
        path = src
        where = f"{src} -> {dst}" if dst is not None else src
    where = where or "(a file this script writes; the system did not name it)"
    why = f"{exc.strerror or os.strerror(code)} ({errno.errorcode.get(code, code)})"
    base = base_dir_setting()
    in_base = path is not None and os.path.abspath(path).startswith(base + os.sep)
    elsewhere = (f"point NANOTRAIN_BASE_DIR (now {base}) at a directory you can write" if in_base or path is None
                 else "choose another path")
    if code in (errno.ENOSPC, errno.EDQUOT):
        todo = ("free some space on that file system (or raise your quota), then run again"
                + (" with --resume=True to continue from the last checkpoint" if trains else ""))
    elif code == errno.EROFS:
        todo = f"the file system is mounted read-only: {elsewhere}, or remount it read-write"
    elif code in (errno.EACCES, errno.EPERM):
        todo = f"fix the permissions of that path or of its directory, or {elsewhere}"
    elif code == errno.EISDIR:
        todo = "that is a directory where a file is expected: move it away, then run again"
    elif code == errno.ENOTDIR:
        culprit = _first_non_directory(path) if path else None
        todo = ("a directory is expected on that path: move the file in its way, then run again" if not culprit else
                f"that is {path_kind(culprit)} where a directory is expected: move it away, then run again"
                if culprit == os.path.abspath(path) else
                f"{culprit} is {path_kind(culprit)} where a directory is expected: move it away, then run again")
    elif path is not None and os.path.isdir(path):  # EEXIST
        todo = "that exists already: move it away, then run again"
    else:
        todo = f"that is {path_kind(path)} where a directory is expected: move it away, then run again"
    return f"{where}: {why}: {todo}"


@contextlib.contextmanager
def os_errors_name(path):
    """
    Re-raises an OSError that does not name the file the user knows as an OSError of the same errno that does: one
    without a file name (a write, flush or fsync of an open file: the system does not name it) names `path` (str);
    one naming a temporary file NAME.tmp<suffix> (removed by then) names NAME. Other errors pass unchanged.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno is None or exc.filename2 is not None:
            raise
        if exc.filename is None:
            name = path
        else:
            head, tail = os.path.split(os.fsdecode(exc.filename))
            cut = tail.rfind(".tmp")
            if cut <= 0:
                raise
            name = os.path.join(head, tail[:cut])
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), name) from exc


@contextlib.contextmanager
def replacing(path, suffix=""):
    """
    Yields a temp file path beside `path` (<path>.tmp<pid><suffix>) for the block to write; when the block ends, the
    temp file replaces `path` (os.replace: never a torn file). If the block raises (an OSError, e.g. a full disk, or
    KeyboardInterrupt) the temp file is removed and the error raised, an OSError naming `path` (not the temp file)
    when it named no file or the temp file; `path` is untouched.
    """
    tmp = f"{path}.tmp{os.getpid()}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path) from exc
        raise
