"""
The Hugging Face hub, asked quickly: offline mode and a fail-fast reachability check, shared by every loader that
reads from the hub (fineweb-edu shards, the chat tasks), so that offline a load fails in seconds with one line
instead of after huggingface_hub's own retries.
"""

import os
import socket
import urllib.parse
import urllib.request

CONNECT_TIMEOUT_S = 5.0


def hub_endpoint():
    """The hub's URL: $HF_ENDPOINT, else https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def offline_mode():
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to 1/ON/YES/TRUE (the libraries use their caches only)."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def check_reachable(endpoint, timeout=CONNECT_TIMEOUT_S):
    """Opens (and closes) a TCP connection to the endpoint's host; raises OSError within ~`timeout` s if offline."""
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    socket.create_connection((url.hostname, port), timeout=timeout).close()


def unreachable_reason():
    """None when the hub looks reachable (or cannot be tested: offline mode uses the cache, a proxy hides the route),
    else a short reason ("offline? cannot reach https://huggingface.co: ...")."""
    if offline_mode():
        return None
    endpoint = hub_endpoint()
    if urllib.request.getproxies().get(urllib.parse.urlparse(endpoint).scheme):
        return None
    try:
        check_reachable(endpoint)
    except OSError as e:
        return f"offline? cannot reach {endpoint}: {e}; with HF_HUB_OFFLINE=1 a cached copy is used"
    return None
