"""The health port's HTTP connections, read on one event loop and answered by a few threads.

The health port takes no token, and the per-job Service exposes it. With a thread per
connection (http.server's ThreadingHTTPServer, plus a timer thread each for the request
deadline), 2,000 connections that sent nothing held 3,385 threads on a data node; when they all
closed at once, the node's Python threads, Flight's included, stalled for seconds: `/live` timed
out, a read took 7.9 s instead of 0.15 s, and the head's status poll timed out and took the whole
cache to `degraded`. Here a connection waiting for its request costs a socket and a coroutine:

- each connection's request head is read on the loop, under one deadline for the whole
  connection (HEALTH_REQUEST_TIMEOUT_SECONDS in service.py), so trickling a byte at a time
  does not extend it;
- a whole request is answered through the handler class (http.server's own parsing and errors:
  400, 414, 431, 501), fed the bytes read: the probes' paths (``inline_paths``, cheap reads of
  the process's state) on the loop itself, so no number of slow ``/status`` or ``/metrics``
  answers delays them; the others by one of ANSWER_THREADS threads;
- at most MAX_WAITING connections wait for their request: one more closes the one that has
  waited longest, once it has waited CLOSE_AFTER_WAITING_SECONDS. A kubelet probe or a Prometheus
  scrape sends its request as it connects, so it is never the longest waiting for long, and
  probes keep their answers while idle connections come and go. A burst
  of real requests is queued for the answering threads, up to MAX_QUEUED; past that a request
  is answered 503 at once (a probe never is: probes are answered on the loop). A new
  connection is never turned away; only the longest-waiting idle one is closed for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

log = logging.getLogger(__name__)

MAX_WAITING = 256
# A connection is closed for a newer one only once it has waited this long for its request: in a
# burst of new connections, one accepted just before the others (a probe whose request the loop
# has not read yet) is not the longest waiting for long. Past MAX_WAITING_BURST the oldest goes
# whatever its age.
CLOSE_AFTER_WAITING_SECONDS = 1.0
MAX_WAITING_BURST = 4 * MAX_WAITING
MAX_QUEUED = 512
ANSWER_THREADS = 4
# Read no further for a request's head: http.server then answers what it finds (431 where its
# headers are too many; lines over 64 KiB are 414 or 431 already).
MAX_REQUEST_HEAD_BYTES = 256 * 1024
# Connections the kernel queues before they are accepted: a burst of 200 scrapes and probes on a
# busy node, at socketserver's default of 5, left some waiting for SYN retries (7 s), past a
# probe's timeout.
LISTEN_BACKLOG = 128
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def listening_socket(host: str, port: int) -> socket.socket:
    """A wildcard host listens on every address, IPv6 included where the kernel has it, as gRPC
    does for the Flight port: on an IPv6-only pod the kubelet probes the pod's IPv6 address."""
    if host in WILDCARD_HOSTS and socket.has_ipv6:
        try:
            return _bound(socket.AF_INET6, ("::", port), dual_stack=True)
        except OSError as err:
            if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL) or host == "::":
                raise
            # A kernel without IPv6: IPv4 alone, below.
    if ":" in host:
        return _bound(socket.AF_INET6, (host.strip("[]"), port))
    return _bound(socket.AF_INET, (host or "0.0.0.0", port))


def _bound(family: socket.AddressFamily, address: tuple[str, int], dual_stack: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:  # ``::`` with IPv4 too, whatever the host's net.ipv6.bindv6only says
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _plain_answer(status: str, text: str, *headers: str) -> bytes:
    body = text.encode()
    lines = [f"HTTP/1.0 {status}", "Content-Type: text/plain", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


BUSY_ANSWER = _plain_answer(
    "503 Service Unavailable", "busy: too many requests wait for an answer; retry shortly\n", "Retry-After: 1"
)
ERROR_ANSWER = _plain_answer("500 Internal Server Error", "the answer failed; the process logged why\n")


def _request_path(head: bytes) -> str | None:
    """The path of a request's first line, without its query; None where it has none."""
    words = head.split(b"\n", 1)[0].split()
    if len(words) < 2:
        return None
    return words[1].split(b"?", 1)[0].decode("latin-1")


def _head_complete(buffer: bytearray, searched_from: int) -> bool:
    """Whether the request's head (its lines up to an empty one) is all in ``buffer``. Only the
    new bytes are searched (with the three before them): a client trickling a byte at a time
    made each read search the whole buffer again."""
    start = max(0, searched_from - 3)
    return buffer.find(b"\r\n\r\n", start) >= 0 or buffer.find(b"\n\n", start) >= 0


class LoopHTTPServer:
    """``handler`` (a BaseHTTPRequestHandler) answering on ``sock``: one request per connection."""

    def __init__(
        self,
        sock: socket.socket,
        handler: type[BaseHTTPRequestHandler],
        deadline_seconds: float,
        inline_paths: frozenset[str] = frozenset(),
    ):
        self._sock = sock
        self._handler = handler
        self._deadline_seconds = deadline_seconds
        self._inline_paths = inline_paths
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._answers = ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="health-answer")
        # Open connections, oldest first: the writer and, while it waits for its request, since
        # when (the loop's clock); None once its request is read.
        self._open: dict[asyncio.StreamWriter, float | None] = {}
        self._queued = 0  # requests waiting for, or being given, an answering thread's answer
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._started = threading.Event()
        self._failure: BaseException | None = None

    def start(self) -> LoopHTTPServer:
        self._thread.start()
        self._started.wait()
        if self._failure is not None:  # the loop never ran, and its thread is ending
            self._thread.join(10)
            self._answers.shutdown(wait=False)
            self._sock.close()
            raise self._failure
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._answers.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._connection, sock=self._sock, backlog=LISTEN_BACKLOG)
            )
        except BaseException as err:  # start() raises it
            self._failure = err
            self._loop.close()
            return
        finally:
            self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()
            with contextlib.suppress(Exception):
                tasks = asyncio.all_tasks(self._loop)
                for task in tasks:
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    def _make_room(self) -> None:
        """With MAX_WAITING connections waiting for their request, close the one that has waited
        longest, once it has waited CLOSE_AFTER_WAITING_SECONDS (at MAX_WAITING_BURST, whatever
        its age)."""
        waiting = [(w, since) for w, since in self._open.items() if since is not None]
        if len(waiting) < MAX_WAITING:
            return
        oldest, since = waiting[0]
        if self._loop.time() - since < CLOSE_AFTER_WAITING_SECONDS and len(waiting) < MAX_WAITING_BURST:
            return
        oldest.transport.abort()
        del self._open[oldest]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._make_room()
        self._open[writer] = self._loop.time()
        answered = False
        try:
            async with asyncio.timeout(self._deadline_seconds):
                head = await self._read_head(reader)
                if writer not in self._open:  # closed to make room
                    return
                self._open[writer] = None
                peer = writer.get_extra_info("peername")
                if _request_path(head) in self._inline_paths:
                    answer = self._answer(head, peer)
                elif self._queued >= MAX_QUEUED:
                    answer = BUSY_ANSWER
                else:
                    self._queued += 1
                    try:
                        answer = await self._loop.run_in_executor(self._answers, self._answer, head, peer)
                    finally:
                        self._queued -= 1
                if answer:
                    writer.write(answer)
                writer.close()
                await writer.wait_closed()  # sent, within the deadline
                answered = True
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass  # a client that said nothing in time, or hung up: routine on a health port
        except asyncio.CancelledError:
            return  # stop(): the connection is closed below (re-raised, 3.11 logs each as an error)
        except Exception as err:  # a bug here: one line, and the connection closed, not a loop traceback
            log.warning("the health port's answer failed: %r", err)
        finally:
            self._open.pop(writer, None)
            if not answered:
                # An answer the client did not read in time is dropped with the connection, not
                # left in the kernel's buffers past the deadline.
                writer.transport.abort()

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes:
        buffer = bytearray()
        while len(buffer) <= MAX_REQUEST_HEAD_BYTES:
            chunk = await reader.read(65536)
            if not chunk:
                break  # the client stopped sending: answer what came (nothing: no answer)
            searched_from = len(buffer)
            buffer += chunk
            if _head_complete(buffer, searched_from):
                break
        return bytes(buffer)

    def _answer(self, head: bytes, peer: object) -> bytes:
        """The handler's answer to ``head``: http.server's parsing and errors, then its do_GET."""
        handler = self._handler.__new__(self._handler)
        handler.request, handler.client_address, handler.server = None, peer, self
        handler.rfile, handler.wfile = io.BytesIO(head), io.BytesIO()
        handler.close_connection = True
        try:
            handler.handle_one_request()
        except Exception as err:  # a status() that failed mid-reload, say: 500, not no answer
            log.warning("health answer to %r failed: %s", _request_path(head), err)
            return ERROR_ANSWER
        return handler.wfile.getvalue()
