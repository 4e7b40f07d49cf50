"""
The automatic batch size's cache: one JSON file per key under <base_dir>/auto_batch_cache/, the key holding every
fact that changes a training step's memory (the model and optimizer settings, sizes, dtype, devices, world size,
margin, torch version, allocator settings and a fingerprint of the code), and the checks an entry must pass before its
size is trusted again.
"""

import errno
import hashlib
import inspect
import json
import os
import sys
import time

import torch

from nanotrain.common import atomic_write_json, get_base_dir, print0

ALGORITHM_VERSION = 1  # bump when the probe recipe, the measurement or the search changes: old cache entries then miss


def code_fingerprint(build_probe):
    """sha256 (hex str) of the Python sources that decide the probe's memory: every .py file of the nanotrain package
    (model, optimizers, nanotrain.auto_batch_size.probe's probe step, the builders), of the top-level package defining build_probe
    and build_probe's own file. In the key, it makes the fake-path peak a pure function of the key."""
    files = set()

    def add_tree(root):
        for dirpath, _, names in os.walk(root):
            files.update(os.path.join(dirpath, n) for n in names if n.endswith(".py"))

    add_tree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the whole nanotrain package
    module = sys.modules.get(getattr(build_probe, "__module__", None) or "")
    package = (getattr(module, "__package__", None) or "").split(".")[0]
    if package and package in sys.modules and getattr(sys.modules[package], "__file__", None):
        add_tree(os.path.dirname(os.path.abspath(sys.modules[package].__file__)))
    try:
        source = inspect.getsourcefile(build_probe)
    except TypeError:  # a builtin or a callable object without source
        source = None
    if source and os.path.isfile(source):  # not for "<stdin>" or notebook cells
        files.add(os.path.abspath(source))
    digest = hashlib.sha256()
    for path in sorted(files):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, os.path.dirname(path) + "/..").encode() + b"\0" + f.read())
    return digest.hexdigest()


def cache_key(*, key_fields, max_seq_len, vocab_size, amp_dtype, compile, devices, world_size, margin, candidates,
              code=None):
    """The cache key (a JSON-able dict) of these arguments (`devices`: every rank's device_memory_budget description;
    `code`: code_fingerprint(build_probe)), the torch version, the CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF,
    PYTORCH_ALLOC_CONF: they change fragmentation) and ALGORITHM_VERSION."""
    return {"algorithm_version": ALGORITHM_VERSION,
            "key_fields": json.loads(json.dumps(key_fields or {}, sort_keys=True, default=str)),
            "max_seq_len": max_seq_len, "vocab_size": vocab_size, "amp_dtype": str(amp_dtype), "compile": bool(compile),
            "devices": devices, "world_size": world_size, "torch": torch.__version__, "margin": margin,
            "candidates": list(candidates), "code": code,
            "alloc_conf": [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")]}


def cache_path(key):
    """<base_dir>/auto_batch_cache/<sha256 of the canonical JSON of key>.json"""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return os.path.join(get_base_dir(), "auto_batch_cache", f"{digest}.json")


def check_probes(batch_size, probes, limit_bytes):
    """
    Raises ValueError (naming what is wrong) unless `probes` (a cache entry's list of dicts with batch_size,
    peak_bytes, result, phase) give batch_size as the answer of the phase that decided it ("compiled" if there are
    compiled probes, else "search"): in that phase batch_size was probed with result "fits", every "fits" probe peaks
    at most limit_bytes (bytes), batch_size is the largest size that fits and is below every size that does not.
    Returns None. Raises KeyError or TypeError for malformed probes.
    """
    phase = "compiled" if any(p["phase"] == "compiled" for p in probes) else "search"
    probes = [p for p in probes if p["phase"] == phase]
    fit = sorted(p["batch_size"] for p in probes if p["result"] == "fits")
    no_fit = sorted(p["batch_size"] for p in probes if p["result"] != "fits")
    if batch_size not in fit:
        raise ValueError(f"device_batch_size={batch_size} has no {phase} probe that fits")
    for p in probes:
        if p["result"] == "fits" and not p["peak_bytes"] <= limit_bytes:
            raise ValueError(f"its {phase} probe at device_batch_size={p['batch_size']} peaks at {p['peak_bytes']} "
                             f"bytes, over this run's limit of {int(limit_bytes)} bytes")
    if fit[-1] != batch_size or (no_fit and no_fit[0] <= batch_size):
        raise ValueError(f"device_batch_size={batch_size} is not the answer of its {phase} probes (fits: {fit}; does "
                         f"not fit: {no_fit})")


def check_cache_location(path):
    """
    Raises the OSError that writing the cache entry `path` would raise after the whole search, before it starts:
    NotADirectoryError naming the cache directory when that is a file, IsADirectoryError naming `path` when the entry
    is a directory (nanotrain.common.run_script prints either as one line: move it away). Returns None otherwise.
    """
    directory = os.path.dirname(path)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)


def read_cached(key, limit_bytes, log=print0):
    """
    The cached device batch size (int) for `key`, or None when there is no entry or it is ignored. limit_bytes: the
    largest margin * budget over the ranks, in bytes (a probe records the max peak over the ranks). A file that is not
    valid JSON, whose stored key differs from `key` (foreign or edited), whose size is not a candidate or whose probes
    do not give that size within limit_bytes (check_probes) is ignored with one warning line naming the file (and left
    to be replaced). Never raises for the file's contents; raises check_cache_location's OSError when the entry could
    not be written (a directory in its place, a file in the cache directory's).
    """
    path = cache_path(key)
    check_cache_location(path)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        batch_size = entry["device_batch_size"]
        if entry["key"] != key:
            raise ValueError("its key does not match this run's key")
        if batch_size not in key["candidates"]:
            raise ValueError(f"device_batch_size={batch_size!r} is not a candidate")
        check_probes(batch_size, entry["probes"], limit_bytes)
        return int(batch_size)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log(f"auto_batch_size: warning: ignoring the cache file {path}: {type(exc).__name__}: {exc}")
        return None


def write_cached(key, batch_size, probes):
    """Writes the cache entry for `key` atomically (nanotrain.common.atomic_write_json). Returns the path."""
    path = cache_path(key)
    atomic_write_json(path, {"key": key, "device_batch_size": batch_size, "probes": probes, "written": time.time()})
    return path


def drop_cached(key):
    """Removes the cache entry for `key` (record["cache_key"]). Returns True if a file was removed."""
    try:
        os.remove(cache_path(key))
        return True
    except FileNotFoundError:
        return False
