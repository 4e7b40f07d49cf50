"""
Runs a script with operating-system errors injected, for tests/test_os_errors.py (run as a subprocess):

    python tests/inject_os_error.py '<rules as JSON>' scripts/<script>.py --flag=value ...

Each rule is {"call": CALL, "match": SUBSTRING, "errno": NAME} (NAME as in the errno module, e.g. "ENOSPC"; optional
"after": how many matching calls succeed first, default 0). CALL says where the error comes from, as the system would
raise it:
    "open"      builtins.open of a path containing SUBSTRING raises OSError(errno, strerror, path)
    "write"     a file opened for writing at such a path raises OSError(errno, strerror) from write/flush (no file
                name, as a full disk reports it); the file itself is created, so a temporary file stays visible
    "makedirs"  os.makedirs of such a path raises OSError(errno, strerror, path)
    "replace"   os.replace / os.rename onto such a path raises OSError(errno, strerror, src, None, dst)
Then the script runs as __main__ (runpy), with sys.argv as if started directly.
"""

import builtins
import errno
import json
import os
import runpy
import sys

RULES = json.loads(sys.argv[1])
_real_open, _real_makedirs, _real_replace, _real_rename = builtins.open, os.makedirs, os.replace, os.rename


def _fires(call, path):
    """The errno of the first rule for `call` whose match is in `path` and whose `after` is used up, else None."""
    for rule in RULES:
        if rule["call"] == call and rule["match"] in os.fsdecode(path):
            if rule.get("after", 0) > 0:
                rule["after"] -= 1
                continue
            return getattr(errno, rule["errno"])
    return None


class _FailingWrites:
    """A file whose writes and flushes raise OSError(code) without a file name; everything else is the file's."""

    def __init__(self, file, code):
        self._file, self._code = file, code

    def _fail(self, *args, **kwargs):
        raise OSError(self._code, os.strerror(self._code))

    write = writelines = flush = _fail

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __iter__(self):
        return iter(self._file)


def _open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)):
        code = _fires("open", file)
        if code is not None:
            raise OSError(code, os.strerror(code), os.fsdecode(file))
        if any(c in mode for c in "wax+"):
            code = _fires("write", file)
            if code is not None:
                return _FailingWrites(_real_open(file, mode, *args, **kwargs), code)
    return _real_open(file, mode, *args, **kwargs)


def _makedirs(name, *args, **kwargs):
    code = _fires("makedirs", name)
    if code is not None:
        raise OSError(code, os.strerror(code), os.fsdecode(name))
    return _real_makedirs(name, *args, **kwargs)


def _moving(real):
    def move(src, dst, *args, **kwargs):
        code = _fires("replace", dst)
        if code is not None:
            raise OSError(code, os.strerror(code), os.fsdecode(src), None, os.fsdecode(dst))
        return real(src, dst, *args, **kwargs)
    return move


builtins.open = _open
os.makedirs = _makedirs
os.replace, os.rename = _moving(_real_replace), _moving(_real_rename)
script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
