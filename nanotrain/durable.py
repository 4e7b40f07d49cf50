"""
Replacing a directory so that a kill at any instant loses nothing: how a checkpoint step (nanotrain.checkpoint) and
the tokenizer's pair of files (nanotrain.tokenizer) are written.

The protocol is the one trusted checkpointers use (torch.distributed.checkpoint, Orbax): make a new directory
complete, make it durable, commit it with one rename, and delete the previous copy only after the commit.
  1. The writer fills <final>.tmp/: every file is fsynced, the directory's *marker* file (a file the writer creates
     last, e.g. a checkpoint's meta.json) is written last and atomically, and the directory is fsynced again. From
     then on <final>.tmp is complete.
  2. commit(): an existing <final> is renamed to <final>.old, <final>.tmp is renamed to <final>, the parent directory
     is fsynced (the commit is now durable: a power loss cannot undo it), then <final>.old is removed.
  3. remove_dir() deletes a directory's marker before anything else, so a half-deleted directory never looks
     complete.
A kill between any two of these operations leaves at least one complete copy among <final>.tmp, <final> and
<final>.old, and the newest complete one is, in that order, .tmp (written after the others), then <final>, then .old
(best_copy). Readers take best_copy() and rename nothing; the one writer calls recover() before it writes, which
finishes or undoes an interrupted replacement: the best copy ends up as <final> and the other copies are removed.

Not protected against: a filesystem that lies about fsync, two writers of the same directory at once (the training
scripts hold the run's lock, nanotrain.run.lock_run_dir), and damage to a committed file after the fact (readers check
the files they load).
"""

import contextlib
import os
import shutil

SUFFIXES = (".tmp", "", ".old")  # the copies of a directory a kill can leave, newest first


def fsync_path(path):
    """fsync of a file or a directory by path (a directory's fsync makes its entries durable: creations, renames).
    Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path, marker):
    """True when `path` is a directory holding its marker file (`marker`: a file name)."""
    return os.path.isfile(os.path.join(path, marker))


def best_copy(final, marker):
    """The newest complete copy of the directory `final` among final + ".tmp", final, final + ".old" (see the module
    docstring), or None when there is none. Reads only."""
    return next((final + suffix for suffix in SUFFIXES if is_complete(final + suffix, marker)), None)


def remove_dir(path, marker):
    """Deletes the directory `path` (if it exists), its marker file first, so that a kill midway leaves a directory
    that no reader takes for complete. Raises OSError if the marker cannot be deleted."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, marker))
    shutil.rmtree(path)


def commit(tmp, final, marker):
    """
    Step 2 of the protocol: replaces the directory `final` by the complete directory `tmp` (which must hold its
    marker; raises ValueError otherwise), through final + ".old", fsyncing the parent directory before the old copy
    is removed. Returns `final`. Raises OSError.
    """
    if not is_complete(tmp, marker):
        raise ValueError(f"{tmp} is not complete (no {marker}): refusing to commit it")
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final):
        old = final + ".old"
        remove_dir(old, marker)  # older than both `final` and the complete `tmp`
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(parent)
        remove_dir(old, marker)
    else:
        os.rename(tmp, final)
        fsync_path(parent)
    return final


def recover(final, marker):
    """
    Run by the one writer of `final` before it writes: the newest complete copy (best_copy) becomes `final`, and
    every other copy (older, or incomplete) is removed, never a complete copy before a newer one is in place.
    Returns `final`, or None when no complete copy exists (all copies removed). Raises OSError.
    """
    best = best_copy(final, marker)
    if best is None:
        for suffix in SUFFIXES:
            remove_dir(final + suffix, marker)
        return None
    if best == final + ".tmp":  # killed after the new copy was complete, before or during its commit
        commit(best, final, marker)
        remove_dir(final + ".old", marker)  # left when `final` itself was missing
    elif best == final + ".old":  # killed between the two renames of a commit, with the new copy incomplete
        remove_dir(final + ".tmp", marker)
        remove_dir(final, marker)
        os.rename(best, final)
        fsync_path(os.path.dirname(os.path.abspath(final)))
    else:
        remove_dir(final + ".tmp", marker)
        remove_dir(final + ".old", marker)
    return final
