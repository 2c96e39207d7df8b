"""The aiodat stream server: :class:`Server` (asyncio.Server's methods), ``create_server``, ``start_server``.

One task per server awaits the PSP's connection-request EVD; each request is
accepted in a task of its own, so a slow handshake does not hold up the others.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable, Dict, List, Optional, Tuple

from aiodat.cm import check_timeout, resolve_host
from aiodat.errors import DATError, InvalidAddress, InvalidParameter, ModelNotSupported
from aiodat.netdev import same_address
from aiodat.streams.pool import IARef
from aiodat.streams.protocol import DEFAULT_LIMIT, StreamConfig, parse_params, split_kwds
from aiodat.streams.transport import RdmaTransport, Resources, stream_port

__all__ = ["Server", "ListenSocket", "create_server", "start_server"]


class ListenSocket:
    """What ``Server.sockets`` lists: the listening address, socket-like (``getsockname()``)."""

    family = socket.AF_INET
    type = socket.SOCK_STREAM
    proto = 0

    def __init__(self, address: str, port: int, psp: Any) -> None:
        self._address, self._port = address, port
        self.family = socket.AF_INET6 if ":" in address else socket.AF_INET
        #: the :class:`aiodat.PSP` listening
        self.psp = psp

    def getsockname(self) -> Tuple[str, int]:
        """(address, port) listened on."""
        return self._address, self._port

    def getpeername(self) -> Tuple[str, int]:
        """A listening point has no peer: raises OSError(ENOTCONN) as a socket does."""
        import errno

        raise OSError(errno.ENOTCONN, "a listening aiodat stream server has no peer")

    def fileno(self) -> int:
        """-1: there is no socket file descriptor."""
        return -1

    def __repr__(self) -> str:
        return f"<aiodat.streams.ListenSocket {self._address}:{self._port}>"


class Server:
    """A listening aiodat stream server, with the methods of :class:`asyncio.Server`.

    ``close()`` stops listening (existing connections stay; ``close_clients()``
    closes them); ``wait_closed()`` waits until the server is closed and every
    connection it accepted is gone (asyncio 3.12+ semantics).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol_factory: Callable[[], asyncio.BaseProtocol],
                 iaref: IARef, psp: Any, cr_evd: Any, cfg: StreamConfig,
                 accept_timeout: Optional[float]) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._iaref = iaref
        self._psp = psp
        self._cr_evd = cr_evd
        self._cfg = cfg
        self._accept_timeout = accept_timeout
        self._sockets: Optional[List[ListenSocket]] = [ListenSocket(psp.address, psp.port, psp)]
        self._transports: Dict[RdmaTransport, None] = {}
        self._pending: Dict["asyncio.Task[None]", None] = {}
        self._serving = False
        self._accept_task: Optional[asyncio.Task[None]] = None
        self._serving_forever_fut: Optional[asyncio.Future[None]] = None
        self._waiters: Optional[List[asyncio.Future[None]]] = []

    # -- asyncio.Server API ----------------------------------------------------------------------
    @property
    def sockets(self) -> Tuple[ListenSocket, ...]:
        """The listening points (one): ``server.sockets[0].getsockname()`` is (address, port)."""
        return tuple(self._sockets or ())

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server runs on."""
        return self._loop

    def is_serving(self) -> bool:
        """True while accepting connections."""
        return self._serving

    async def start_serving(self) -> None:
        """Start accepting (requests that came before wait in the PSP's queue)."""
        self._start_serving()
        await asyncio.sleep(0)

    def _start_serving(self) -> None:
        if self._sockets is None:
            raise RuntimeError(f"server {self!r} is closed")
        if self._serving:
            return
        self._serving = True
        self._accept_task = self._loop.create_task(self._accept_loop())

    async def serve_forever(self) -> None:
        """Accept until cancelled; then close and wait_closed()."""
        if self._serving_forever_fut is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if self._sockets is None:
            raise RuntimeError(f"server {self!r} is closed")
        self._start_serving()
        self._serving_forever_fut = self._loop.create_future()
        try:
            await self._serving_forever_fut
        except asyncio.CancelledError:
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serving_forever_fut = None

    def close(self) -> None:
        """Stop listening (the PSP is freed; connections already made stay open)."""
        if self._sockets is None:
            return
        self._sockets = None
        self._serving = False
        for task in [self._accept_task, *self._pending]:
            if task is not None and not task.done():
                task.cancel()
        for handle in (self._psp, self._cr_evd):
            try:
                handle.close()
            except DATError:
                pass
        if self._serving_forever_fut is not None and not self._serving_forever_fut.done():
            self._serving_forever_fut.cancel()
            self._serving_forever_fut = None
        self._maybe_done()

    def close_clients(self) -> None:
        """Close every connection this server accepted (gracefully: EOF, then disconnect)."""
        for transport in list(self._transports):
            transport.close()

    def abort_clients(self) -> None:
        """Drop every connection this server accepted at once."""
        for transport in list(self._transports):
            transport.abort()

    async def wait_closed(self) -> None:
        """Wait until close() was called and every accepted connection is closed."""
        if self._waiters is None:
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    async def __aenter__(self) -> "Server":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()

    def __repr__(self) -> str:
        where = self.sockets[0].getsockname() if self.sockets else "closed"
        return f"<aiodat.streams.Server {where} connections={len(self._transports)}>"

    # -- internals -------------------------------------------------------------------------------
    def _maybe_done(self) -> None:
        if self._sockets is not None or self._transports or self._pending:
            return
        waiters, self._waiters = self._waiters, None
        try:
            self._iaref.release()
        finally:  # (a release that raised must not leave wait_closed() waiting for ever)
            for waiter in waiters or ():
                if not waiter.done():
                    waiter.set_result(None)

    def _detach(self, transport: RdmaTransport) -> None:
        self._transports.pop(transport, None)
        self._maybe_done()

    async def _accept_loop(self) -> None:
        while self._serving:
            try:
                event = await self._cr_evd.wait_one()
            except asyncio.CancelledError:
                if self._serving:
                    # cancelled from outside (a shutdown cancelling every task): nothing would accept
                    # any more, so the server closes, and clients are refused instead of timing out
                    self._accept_task = None  # (this task: it ends by raising, close() need not cancel it)
                    self.close()
                raise
            except DATError as exc:
                if self._sockets is None:
                    return
                # The listener failed under an open server (its IA closed, say): nothing more can be
                # accepted.  The server closes, as by close(), and says why, instead of staying
                # "serving" with its accept task dead and its error unread.
                self._loop.call_exception_handler({"message": "aiodat stream server: listening failed; the "
                                                   "server is closed", "exception": exc, "server": self})
                self.close()
                return
            cr = getattr(event, "cr", None)
            if cr is None:
                continue
            task = self._loop.create_task(self._accept_one(cr))
            self._pending[task] = None
            task.add_done_callback(self._accepted)

    def _accepted(self, task: "asyncio.Task[None]") -> None:
        self._pending.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self._loop.call_exception_handler({"message": "aiodat stream server: accepting a connection failed",
                                               "exception": task.exception(), "server": self})
        self._maybe_done()

    async def _accept_one(self, cr: Any) -> None:
        try:
            peer = parse_params(cr.private_data)
        except DATError:
            try:
                cr.reject(b"not an aiodat stream")
            except DATError:  # (its peer gave it up already)
                pass
            return
        ia = self._iaref.ia
        iaref = self._iaref.share()  # each connection holds the IA too (it may outlive the server)
        res = None
        try:
            res = Resources(ia, self._cfg)
            try:
                await cr.accept(res.ep, res.params(), timeout=self._accept_timeout)
            except (ConnectionError, TimeoutError):
                # The client gave up before the handshake ended (its connect timed out or was
                # cancelled, its process ended): an everyday event, which asyncio's accept
                # reports only in debug mode; not an error of the server's to log.
                if self._loop.get_debug():
                    raise
                res.close()
                iaref.release()
                return
            # a factory that raises: the error goes to the loop's handler (_accepted) and the
            # connection is dropped here, as asyncio drops its socket, not left open and unread
            transport = RdmaTransport(self._loop, res, iaref, peer, self._factory(), on_lost=self._detach)
        except BaseException:
            if res is not None:
                res.close()
            else:
                try:
                    cr.reject()
                except DATError:
                    pass
            iaref.release()
            raise
        self._transports[transport] = None
        transport._start()


class _ServerStreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's StreamReaderProtocol, closing the connection when the ``client_connected_cb`` task
    is cancelled, as Python 3.12's does.  Python 3.11's leaves it open: the peer never hears of
    the end, and ``wait_closed()`` (which waits for every connection) would wait for ever."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        task: Optional["asyncio.Task[Any]"] = getattr(self, "_task", None)
        if task is not None:
            task.add_done_callback(lambda t: transport.close() if t.cancelled() else None)


async def create_server(protocol_factory: Callable[[], asyncio.BaseProtocol], host: Any = None,
                        port: Optional[int] = None, *, ia: Any = None, backlog: int = 100,
                        start_serving: bool = True, accept_timeout: Optional[float] = 30.0,
                        **kwds: Any) -> Server:
    """``loop.create_server`` over RDMA: listen on ``host:port`` (port 0 or None: any free port).

    ``host`` must be the IPv4 address of an RDMA device (or None / "" /
    "0.0.0.0" for the default device; the server listens on that device's
    address).  ``ia``, ``buffer_size``, ``recv_depth``, ``window_size``,
    ``rdma_threshold`` and ``busy_poll_us`` as for :func:`create_connection`
    (each accepted connection gets them).
    """
    cfg, rest = split_kwds(kwds)
    if rest:
        raise TypeError(f"create_server() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    if isinstance(host, (list, tuple)):
        if len(host) != 1:
            raise ModelNotSupported("an aiodat stream server listens on one address; pass one host")
        host = host[0]
    if host in ("", "0.0.0.0"):
        host = None
    if host is not None and not isinstance(host, str):
        raise InvalidAddress(f"host must be an IPv4 address string or None, not {type(host).__name__}")
    # checked here, not at each connection's accept (where it failed into the loop's handler)
    check_timeout(accept_timeout, "accept_timeout")
    if port is None:
        port = 0
    port = stream_port(port, lowest=0)
    if not isinstance(backlog, int) or isinstance(backlog, bool):
        raise InvalidParameter(f"backlog must be an int, got {backlog!r}")
    loop = asyncio.get_running_loop()
    if host is not None:
        host = await resolve_host(host)
    iaref = IARef(ia, host, listening=True)
    try:
        if host is not None and not same_address(iaref.ia.address or "", host):
            raise InvalidAddress(f"cannot listen on {host}: the IA {iaref.ia.name} has address "
                                 f"{iaref.ia.address} (an aiodat server listens on its IA's address)")
        from aiodat.evd import EvdFlags

        # as the kernel clamps a socket's backlog to somaxconn: to what the device's EVDs hold
        backlog = min(max(8, backlog), iaref.ia._device_attr.max_cqe)
        cr_evd = iaref.ia.create_evd(backlog, EvdFlags.CR)
        try:
            psp = iaref.ia.create_psp(port, cr_evd, backlog) if port else iaref.ia.create_psp_any(cr_evd, backlog)
        except BaseException:
            cr_evd.close()
            raise
    except BaseException:
        iaref.release()
        raise
    server = Server(loop, protocol_factory, iaref, psp, cr_evd, cfg, accept_timeout)
    if start_serving:
        server._start_serving()
        try:
            await asyncio.sleep(0)
        except BaseException:  # (cancelled here, the server would listen on with nobody to close it)
            server.close()
            raise
    return server


async def start_server(client_connected_cb: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
                       host: Any = None, port: Optional[int] = None, *, limit: int = DEFAULT_LIMIT,
                       **kwds: Any) -> Server:
    """Start an aiodat stream server: the RDMA twin of :func:`asyncio.start_server`.

    ``client_connected_cb(reader, writer)`` is called (a coroutine function is
    run as a task) with asyncio's own StreamReader and StreamWriter for each
    connection.  Keyword arguments as :func:`create_server` (``backlog``,
    ``start_serving``, ``ia``, the :class:`StreamConfig` fields).
    """
    loop = asyncio.get_running_loop()
    # checked here: asyncio's StreamReader refuses a bad one only at each connection
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise InvalidParameter(f"limit must be an int > 0, got {limit!r}")

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return _ServerStreamProtocol(reader, client_connected_cb, loop=loop)

    return await create_server(factory, host, port, **kwds)
