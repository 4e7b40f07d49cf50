"""
Reading a torch.save file safely: torch.load(weights_only=True), so no arbitrary pickle is ever run, with every way
such a file can be unusable (missing, empty, truncated, not a torch.save file, a pickle of arbitrary Python objects)
turned into one CheckpointError line naming the file.
"""

import os
import warnings

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


def _torch_reason(exc):
    """The first informative line of torch.load's error `exc`, without its advice to load with weights_only=False."""
    text = str(exc).split("WeightsUnpickler error:", 1)[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln]
    first = lines[0].split(". This is an internal miniz error")[0].split(" was not an allowed global")[0] if lines else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def load_tensor_file(file, device):
    """
    torch.load(file, map_location=device, weights_only=True): the tensors, dicts, lists and plain values of a
    torch.save file; no arbitrary pickle is ever run. Raises CheckpointError, one line naming the file, if it is
    missing, unreadable, empty, truncated or otherwise not a torch.save file, or a pickle that would import arbitrary
    Python objects ("is not a plain tensor file (...)" with torch's reason, e.g. the global it refused) instead of
    torch's multi-paragraph advice.
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
        raise CheckpointError(file, f"is not a plain tensor file: truncated, damaged, or holding arbitrary Python "
                                    f"objects; refusing to load it ({_torch_reason(exc)})") from None
