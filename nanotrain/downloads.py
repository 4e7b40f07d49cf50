"""
Files fetched once per machine into the base directory (the CORE eval bundle, the gold-bpb rows): downloaded to a
temporary file with a timeout, checked, then turned into a complete directory that is committed with one rename
(nanotrain.durable), under an exclusive lock so that ranks and concurrent runs wait for one download instead of racing.
Offline, every failure is one line naming the URL, the size and what to do instead (a UserError), never a traceback,
and nothing half-written is left behind.

Every file of such a directory is recorded in its marker (a JSON file written last) with its sha256 and its row count
(lines), and checked against that record on every load (ensure_built, check_manifest): a file cut, edited, emptied,
deleted or damaged on disk after the download is found before anything is read from it, and fetched again once.

The Hugging Face hub, asked quickly (the last chapter): offline mode and a fail-fast reachability check for every
loader that reads from the hub, so that offline a load fails in seconds with one line.
"""

import contextlib
import hashlib
import json
import os
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request

from nanotrain.common import any_rank, atomic_write_json, get_base_dir, get_dist_info, print0
from nanotrain.durable import commit, fsync_path, is_complete, recover
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


def file_digest(path):
    """(sha256 hex, rows) of the file `path`: rows is its number of lines (newline characters, plus one for a last
    line without one). Raises OSError."""
    h, rows, last = hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            rows += chunk.count(b"\n")
            last = chunk[-1:]
    return h.hexdigest(), rows + (last != b"\n")


def file_manifest(folder, skip=()):
    """{path relative to `folder` ("/"-separated): {"sha256": hex, "rows": int}} of every file under `folder`, except
    the names in `skip` at its top. Raises OSError."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel not in skip:
                sha, rows = file_digest(os.path.join(root, name))
                out[rel] = {"sha256": sha, "rows": rows}
    return out


def check_manifest(folder, files):
    """
    None when every file in `files` (file_manifest's dict) is under `folder` with that sha256, else one phrase naming
    the first file that differs and how: "<folder>/<file>: missing", "...: 3 rows, expected 4", "...: same 4 rows but
    sha256 ab12..., expected cd34... (its content changed)". Files of `folder` not in `files` are not looked at.
    """
    for rel, want in files.items():
        path = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(path):
            return f"{path}: missing"
        sha, rows = file_digest(path)
        if rows != want["rows"]:
            return f"{path}: {rows} rows, expected {want['rows']}"
        if sha != want["sha256"]:
            return (f"{path}: same {rows} rows but sha256 {sha[:12]}..., expected {want['sha256'][:12]}... (its content "
                    f"changed)")
    return None


def write_marker(folder, marker, info):
    """Writes the marker file `marker` of the complete directory `folder` (the last file a builder writes): `info` (a
    JSON-able dict) with "files": file_manifest(folder) of every other file, fsynced with the directory. Returns the
    manifest. Raises OSError."""
    files = file_manifest(folder, skip=(marker,))
    atomic_write_json(os.path.join(folder, marker), dict(info, files=files))
    fsync_path(folder)
    return files


def commit_files(final, marker, files, info):
    """Makes the complete directory `final` of `files` ({name: text}, written as UTF-8): they go into final.tmp/,
    then the marker (write_marker with `info`), which is then committed (nanotrain.durable.commit). final.tmp is
    removed on every path. Raises OSError."""
    tmp = final + ".tmp"
    try:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        write_marker(tmp, marker, info)
        commit(tmp, final, marker)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def read_manifest(folder, marker):
    """The "files" manifest recorded in `folder`'s marker, or None when the marker has none or is not JSON."""
    try:
        with open(os.path.join(folder, marker), encoding="utf-8") as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return files if isinstance(files, dict) else None


def damage(folder, marker):
    """None when the complete directory `folder` matches the manifest in its marker, else one phrase saying what
    differs (check_manifest), or that the marker records no manifest."""
    files = read_manifest(folder, marker)
    if files is None:
        return f"{os.path.join(folder, marker)} records no per-file checksums (made by an older nanotrain, or damaged)"
    return check_manifest(folder, files)


def ensure_built(name, marker, build):
    """
    The directory <base_dir>/<name>, complete (holding `marker`) and matching the per-file manifest its marker records
    (see the module docstring), checked on every call. When it is not complete, build(base_dir, final) makes it (and
    commits it with nanotrain.durable.commit after writing the marker with write_marker), under the exclusive lock
    <base_dir>/<name>.lock, after recovering a copy a killed process left, so that ranks and concurrent runs build it
    once. When a file differs from the manifest, the directory is built (fetched) again once, a warning line naming
    the file first. Returns its path. Raises what build raises, and UserError (one line: the file, what differs,
    what to do) when the fetch again fails or its result differs too.
    """
    base = get_base_dir()
    final = os.path.join(base, name)
    lock = os.path.join(base, name + ".lock")
    if not is_complete(final, marker):
        with exclusive(lock):
            if recover(final, marker) is None:
                build(base, final)
    problem = damage(final, marker)
    if problem is None:
        return final
    with exclusive(lock):
        problem = damage(final, marker)  # another rank or run may have fetched it again meanwhile
        if problem is not None:
            print0(f"warning: {problem}; fetching {name} again")
            try:
                build(base, final)
            except UserError as e:
                raise UserError(f"{problem}, and fetching it again failed: {e}") from None
            again = damage(final, marker)
            if again is not None:
                raise UserError(f"{again}, right after fetching {name} again: the source itself is not what was "
                                f"recorded; remove {final} and run again") from None
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
    got = file_digest(dest)[0]
    if got != sha256:
        os.remove(dest)
        raise UserError(f"{url}: sha256 {got}, expected {sha256}: not {what} (damaged or another file); "
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


# ----------------------------------------------------------------------------- the Hugging Face hub, asked quickly
# offline mode and a fail-fast reachability check, shared by every loader that reads from the hub (fineweb-edu shards,
# the chat tasks, lm-eval's data), so that offline a load fails in seconds with one line instead of after
# huggingface_hub's own retries

HUB_CONNECT_TIMEOUT_S = 5.0  # seconds to open a TCP connection to the hub


def hub_endpoint():
    """The hub's URL: $HF_ENDPOINT, else https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def offline_mode():
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to 1/ON/YES/TRUE (the libraries use their caches only)."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def check_reachable(endpoint, timeout=HUB_CONNECT_TIMEOUT_S):
    """Opens (and closes) a TCP connection to the endpoint's host; raises OSError within ~`timeout` s if offline."""
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    socket.create_connection((url.hostname, port), timeout=timeout).close()


def behind_proxy(url):
    """True when a proxy is set for `url`'s scheme (a TCP check of its host would then say nothing)."""
    return bool(urllib.request.getproxies().get(urllib.parse.urlparse(url).scheme))


def unreachable_reason():
    """None when the hub looks reachable (or cannot be tested: offline mode uses the cache, a proxy hides the route),
    else a short reason ("offline? cannot reach https://huggingface.co: ...")."""
    endpoint = hub_endpoint()
    if offline_mode() or behind_proxy(endpoint):
        return None
    try:
        check_reachable(endpoint)
    except OSError as e:
        return f"offline? cannot reach {endpoint}: {e}; with HF_HUB_OFFLINE=1 a cached copy is used"
    return None
