"""
What stands between the network and the server's routes (scripts/chat_serve.py), so that no request costs the server
more than its limits and every refusal is an OpenAI error object ({"error": {"message", "type", "param", "code"}})
with its status.

Guard, an ASGI middleware, before any route runs:
  - Host: a request whose Host header names another site than this server is refused (403). Accepted: localhost,
    127.0.0.1, [::1], the bound address, any IP address when bound to every interface (0.0.0.0, ::), and the names
    in allowed_hosts ("*": any). A page on another site can otherwise drive a local server through DNS rebinding
    (the site's name re-pointed at 127.0.0.1: the browser still sends the site's name as Host).
  - the API key, on /v1/ routes: `Authorization: Bearer <key>`, compared in constant time (hmac.compare_digest), 401.
  - a POST to /v1/ must say Content-Type: application/json (415): a page on any site may POST text/plain to any
    address without the browser asking the server first (a CORS "simple request"); a JSON POST needs the browser's
    preflight (OPTIONS), which this server does not grant.
  - the body of a /v1/ POST: at most max_body_bytes, announced by Content-Length or chunked alike; reading stops at
    the limit (413; the rest the client sends is discarded by uvicorn, not kept), and within body_timeout seconds of
    its headers (408: a body trickled a byte at a time holds no request open). It is read and parsed here, once:
    the routes take the JSON value from request.state.json. Not JSON: 422; nested deeper than the parser goes or a
    number longer than Python reads (int's 4300-digit limit): 400; `n` other than 1: 400 (one choice per request).
install_error_handlers: unknown routes (404), wrong methods (405) and any exception a route lets through (500
server_error) answer error objects too.
until_gone: awaits a route's work unless its client disconnects first (then cancels it).
guarded_protocol: uvicorn's HTTP/1.1 protocol (h11) with an idle timeout and a connection cap, so that idle sockets
cannot starve the server (uvicorn times a connection out only after a response, never before its first request,
and its limit_concurrency counts idle connections too, so idle sockets would turn every request into a 503).
"""

import asyncio
import hmac
import ipaddress
import json

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def error_body(status, message, param=None):
    """The OpenAI error object (dict) for an HTTP `status` (int): its type from the status (server_error for 5xx)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": None}}


def key_matches(authorization, key):
    """True when the Authorization header's value (str, or None when absent) is `Bearer <key>`, compared in constant
    time (hmac.compare_digest: the time taken does not tell how many leading characters were right)."""
    if authorization is None:
        return False
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode())


def host_name(header):
    """The host of a Host header's value without its port, lower case: "[::1]:8000" -> "[::1]", "Example:80" ->
    "example"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_ip(name):
    """True when `name` (a host_name) is an IPv4 address or a bracketed IPv6 address."""
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
        return True
    except ValueError:
        return False


class Guard:
    """
    The ASGI middleware of the module docstring around `app`. bound_host: the address the server binds (str);
    allowed_hosts: more Host names to accept (iterable of str; "*" accepts any); key: the API key ("" for none);
    max_body_bytes: the largest request body (int); body_timeout: seconds the body may take (float). The JSON value of a /v1/ POST is put in scope["state"]["json"]
    (request.state.json) and its body replayed to the app (request.body() still works).
    """

    def __init__(self, app, bound_host, allowed_hosts=(), key="", max_body_bytes=1_000_000, body_timeout=10.0):
        self.app, self.key, self.max_body_bytes, self.body_timeout = app, key, max_body_bytes, body_timeout
        names = {n.strip().lower() for n in allowed_hosts if n.strip()}
        self.any_host = "*" in names
        self.any_ip = bound_host in ("0.0.0.0", "::", "")
        bound = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.hosts = names | set(LOCAL_NAMES) | {bound.lower()}

    def host_ok(self, header):
        """True when a Host header's value (str, or None when absent: HTTP/1.0) names this server."""
        if header is None or self.any_host:
            return True
        name = host_name(header)
        return name in self.hosts or (self.any_ip and is_ip(name))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refuse = lambda status, message, param=None: respond(send, status, error_body(status, message, param))
        if not self.host_ok(headers.get("host")):
            return await refuse(403, f"Host {headers['host']!r} is not this server's name (a page on another site "
                                     f"may be reaching it through DNS rebinding); the server's --allowed_hosts "
                                     f"setting adds names")
        api = scope["path"].startswith("/v1/")
        if api and self.key and not key_matches(headers.get("authorization"), self.key):
            return await refuse(401, "invalid or missing API key (Authorization: Bearer ...)")
        if not (api and scope["method"] == "POST"):
            return await self.app(scope, receive, send)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return await refuse(415, f"Content-Type: expected application/json, got {media or 'none'}")
        length = headers.get("content-length")
        too_big = f"the request body is over {self.max_body_bytes} bytes"
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body_bytes):
            return await refuse(413, too_big)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:  # as it comes, never more than the limit (uvicorn pauses the socket until this reads)
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await refuse(408, f"the request body did not arrive within {self.body_timeout:g} s")
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await refuse(413, too_big)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            value = json.loads(raw)
        except RecursionError:
            return await refuse(400, "the body's JSON is nested too deep")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return await refuse(422, f"the body is not JSON: {e}")
        except ValueError as e:  # int's digit limit: "Exceeds the limit (4300 digits) for integer string ..."
            return await refuse(400, f"the body's JSON cannot be read: {str(e).split(';')[0]}")
        if isinstance(value, dict) and value.get("n", 1) not in (1, None):
            return await refuse(400, "n: only 1 choice per request is supported", "n")
        scope.setdefault("state", {})["json"] = value
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await self.app(scope, replay, send)


async def respond(send, status, body):
    """Sends a complete JSON response (ASGI) of `status` with the JSON value `body`."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def install_error_handlers(app):
    """Makes the FastAPI `app` answer an unknown route (404), a wrong method (405), a body that does not fit a
    route's schema (422) and any exception a route raises (500 server_error) with error objects."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request, e):
        return JSONResponse(error_body(422, f"the request does not fit the schema: {e.errors()[:1]}"), status_code=422)

    @app.exception_handler(Exception)
    async def server_error(request, e):
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)


async def until_gone(request, work):
    """
    Awaits `work` (a coroutine) unless the client of `request` (a starlette Request whose body was read) disconnects
    first. Returns (True, work's result), or (False, None) once the client is gone: `work` is then cancelled (its
    finally blocks run, e.g. a request's cancel, which frees its row). Raises what `work` raised.
    """
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return False, None
    return True, task.result()


def guarded_protocol(max_connections, idle_timeout):
    """
    uvicorn's h11 protocol class (for uvicorn.Config(http=...)) with two guards. idle_timeout (seconds): a connection
    with no request in progress (open without having sent a whole request's headers, or idle between keep-alive
    requests) is closed that long after it opened or after its last response, however it trickles bytes.
    max_connections: a connection opened beyond this many closes the one idle the longest (itself when none is
    idle), so the server's open files never run out while clients still get in.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        idle_timer = idle_since = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()
            live = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
            if len(live) > max_connections:  # (closed ones stay listed until their connection_lost, a tick later)
                idle = [c for c in live if c is not self and getattr(c, "idle_since", None) is not None and c._idle()]
                (min(idle, key=lambda c: c.idle_since) if idle else self)._close()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self.idle_timer is not None:
                self.idle_timer.cancel()
            super().connection_lost(exc)

        def _idle(self):
            return self.cycle is None or self.cycle.response_complete

        def _arm(self):
            if self.idle_timer is not None:
                self.idle_timer.cancel()
            self.idle_since = self.loop.time()
            self.idle_timer = self.loop.call_later(idle_timeout, self._expire)

        def _expire(self):
            self.idle_timer = None
            if self._idle():
                self._close()

        def _close(self):
            if not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

    return GuardedH11Protocol
