"""
Files fetched once per machine into the base directory (the CORE eval bundle, the gold-bpb rows): downloaded to a
temporary file with a timeout, checked, then turned into a complete directory that is committed with one rename
(nanotrain.durable), under an exclusive lock so that ranks and concurrent runs wait for one download instead of racing.
Offline, every failure is one line naming the URL, the size and what to do instead (a UserError), never a traceback,
and nothing half-written is left behind.
"""

import contextlib
import hashlib
import os
import urllib.error
import urllib.request

from nanotrain.common import any_rank, get_base_dir, get_dist_info
from nanotrain.durable import is_complete, recover
from nanotrain.errors import UserError

try:
    import fcntl
except ImportError:  # not on Windows: no lock, a single process is assumed
    fcntl = None

CONNECT_TIMEOUT_S = 10.0  # seconds for the connection and for every read of the download


@contextlib.contextmanager
def exclusive(path):
    """
    Holds an exclusive fcntl.flock on the file `path` (created) while the block runs: a second process (another rank,
    a concurrent run) taking the same lock waits until the first one leaves its block. The kernel releases the lock
    however the holder ends, SIGKILL included. Raises OSError when the lock file cannot be created.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def ensure_built(name, marker, build):
    """
    The directory <base_dir>/<name>, complete (holding `marker`): when it is not, build(base_dir, final) makes it
    (and commits it with nanotrain.durable.commit), under the exclusive lock <base_dir>/<name>.lock, after recovering
    a copy a killed process left, so that ranks and concurrent runs build it once. Returns its path. Raises what
    build raises.
    """
    base = get_base_dir()
    final = os.path.join(base, name)
    if not is_complete(final, marker):
        with exclusive(os.path.join(base, name + ".lock")):
            if recover(final, marker) is None:
                build(base, final)
    return final


def download(url, dest, what, hint, timeout=CONNECT_TIMEOUT_S):
    """
    Downloads `url` (http(s):// or file://) to the file `dest`: the bytes go to dest + ".part", renamed to `dest`
    only when the transfer is complete (the size the server announced, when it announced one). Returns `dest`.
    Raises UserError, one line "cannot download <what> from <url>: <reason>; <hint>", for any network failure
    (no route, DNS, refused, timeout after `timeout` seconds without data, HTTP error, short read); the .part file is
    removed on every failure, Ctrl-C included. Raises OSError for a local file-system error (a full disk).
    """
    part = dest + ".part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)

    def failed(reason):
        return UserError(f"cannot download {what} from {url}: {reason}; {hint}")

    try:
        try:
            r = urllib.request.urlopen(url, timeout=timeout)
        except urllib.error.URLError as e:
            raise failed(getattr(e, "reason", e)) from None
        except (OSError, ValueError) as e:  # a timeout, a reset connection, a malformed URL
            raise failed(getattr(e, "strerror", None) or e) from None
        with r, open(part, "wb") as f:  # errors of the local file (a full disk) propagate as OSError
            expected = r.headers.get("Content-Length")
            while True:
                try:
                    chunk = r.read(1 << 20)
                except OSError as e:  # the network during the transfer
                    raise failed(f"the transfer stopped after {f.tell():,} bytes ({e})") from None
                if not chunk:
                    break
                f.write(chunk)
            got = f.tell()
        if expected is not None and int(expected) != got:
            raise failed(f"the transfer stopped after {got:,} of {int(expected):,} bytes")
        os.replace(part, dest)
    finally:
        if os.path.exists(part):
            os.remove(part)
    return dest


def download_verified(url, dest, sha256, what, hint):
    """
    download(url, dest, what, hint), then the file's sha256 checked against `sha256` (hex). Returns `dest`.
    Raises download's UserError, or UserError ("... sha256 X, expected Y ...") with the file removed when it is not the
    pinned file; OSError for a local file-system error.
    """
    download(url, dest, what, hint)
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != sha256:
        os.remove(dest)
        raise UserError(f"{url}: sha256 {h.hexdigest()}, expected {sha256}: not {what} (damaged or another file); "
                        f"run again to download it again")
    return dest


def rank0_first(fetch, device):
    """
    fetch() on rank 0 first, then on the other ranks (which then find the files in place), so that an offline machine
    fails once, in one line, and not once per rank in turn behind the lock. Collective under DDP (`device` carries the
    agreement). Returns fetch()'s value. Raises rank 0's UserError or OSError on rank 0, and UserError on the others.
    """
    rank = get_dist_info()[1]
    error, value = None, None
    if rank == 0:
        try:
            value = fetch()
        except (UserError, OSError) as e:
            error = e
    failed = any_rank(error is not None, device)
    if error is not None:
        raise error
    if failed:
        raise UserError("rank 0 could not fetch the evaluation data (see its error)")
    return value if rank == 0 else fetch()
