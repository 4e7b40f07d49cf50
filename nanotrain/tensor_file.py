"""
Reading a torch.save file safely: torch.load(weights_only=True), so no arbitrary pickle is ever run, with every way
such a file can be unusable (missing, empty, truncated, not a torch.save file, a pickle of arbitrary Python objects)
turned into one CheckpointError line naming the file. A pickle that would import foreign objects is told apart from a
damaged file by reading its opcodes with pickletools, which runs nothing.
"""

import os
import pickletools
import warnings
import zipfile

import torch

from nanotrain.errors import UserError


class CheckpointError(UserError):
    """
    A checkpoint file that cannot be used: missing, empty, truncated, not a torch.save file, a pickle of arbitrary
    Python objects, a meta.json without the keys its reader needs, or weights that do not fit the model_config.
    `file`: the file's path; `problem`: what is wrong with it. str() is the one line "<file> <problem>".
    """

    def __init__(self, file, problem):
        problem = " ".join(problem.splitlines())  # one line, whatever a library's message held
        super().__init__(f"{file} {problem}")
        self.file, self.problem = file, problem


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}


def _imported_names(data):
    """
    "module.name" of every object the pickle `data` (bytes or a binary file) would import (GLOBAL, INST, STACK_GLOBAL), read with
    pickletools, which parses the opcodes and runs nothing. Raises an Exception (ValueError mostly) if `data` is not
    one complete pickle.
    """
    names, strings, memo, top = [], [], {}, None
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            names.append(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":  # module and name are the last two strings pushed (directly or from the memo)
            names.append(".".join(strings[-2:]) if len(strings) >= 2 else "an unnamed object")
        if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if arg is None else arg] = top
            continue
        if op.name in ("GET", "BINGET", "LONG_BINGET"):
            top = memo.get(arg)
        elif op.name in _STRING_OPS:
            top = arg
        elif op.stack_after:
            top = None
        else:
            continue
        if isinstance(top, str):
            strings.append(top)
    return names


def _foreign_imports(file):
    """
    The objects other than torch's (module torch or torch.*, collections.OrderedDict) that the pickle torch.load
    reads from `file` would import: the data.pkl of a zip archive (torch.save's format), else the file itself.
    A sorted list of "module.name"; [] when the pickle is damaged or `file` is no pickle at all.
    """
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as z:
                names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                with z.open(names[0]) as f:
                    imported = _imported_names(f)
        else:
            with open(file, "rb") as f:
                imported = _imported_names(f)
    except Exception:  # not one complete pickle (or no data.pkl in the archive): damaged, or not a pickle at all
        return []
    return sorted({n for n in imported if n.split(".")[0] != "torch" and n != "collections.OrderedDict"})


def _torch_reason(exc):
    """The first informative line of torch.load's error `exc`, without its advice to load with weights_only=False."""
    text = str(exc).split("WeightsUnpickler error:", 1)[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln]
    first = lines[0].split(". This is an internal miniz error")[0] if lines else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def load_tensor_file(file, device):
    """
    torch.load(file, map_location=device, weights_only=True): the tensors, dicts, lists and plain values of a
    torch.save file; no arbitrary pickle is ever run. Raises CheckpointError, one line naming the file, if it is
    missing, unreadable, empty, truncated or otherwise not a torch.save file, or a pickle that would import arbitrary
    Python objects ("is not a plain tensor file ...; refusing to load it"; told apart from a damaged file with
    pickletools, which runs nothing) instead of torch's multi-paragraph advice.
    """
    if not os.path.isfile(file):
        raise CheckpointError(file, "is missing")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on the pickle protocol of a file it is about to refuse
            return torch.load(file, map_location=device, weights_only=True)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:
        if isinstance(exc, PermissionError):  # other OSErrors (EINVAL from a seek) come from a damaged file
            raise CheckpointError(file, f"cannot be read ({exc.strerror or exc})") from None
        if os.path.getsize(file) == 0:
            raise CheckpointError(file, "is empty") from None
        foreign = _foreign_imports(file)
        if foreign:
            raise CheckpointError(file, f"is not a plain tensor file (it holds arbitrary Python objects); refusing to "
                                        f"load it (it would import {', '.join(foreign[:3])})") from None
        raise CheckpointError(file, f"is truncated or not a torch.save file ({_torch_reason(exc)})") from None
