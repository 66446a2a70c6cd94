"""A light client transport on py-libp2p: no Go daemon and no DHT in the client's process.

`LightNode` has what the client uses of `swarm.net.transport.Node`: `open(peer, protocol)` gives a `Stream`
(an asyncio reader and writer), `get_records(keys)` gives the records under some DHT keys, `peer_id`. So
sessions, routing, failover, chaining and `generate()` run over it unchanged
(`ClientConfig(transport="libp2p")`, `--transport libp2p`).

- **Discovery without the DHT.** Records come from the records protocol (`swarm.net.record_service`): the
  initial peers (bootstrap nodes) and the peers learned from records answer with what they read; every
  record is checked here (`records.verify`), at least two sources are asked when two are known, and
  sources merge by sequence number. The replies also say where the signers are; a connection authenticates
  the peer id, so a wrong address only fails.
- **The bridge.** py-libp2p runs on trio, the client on asyncio: trio runs in a thread of its own, and
  each call is handed to it with `TrioToken.run_sync_soon` (non-blocking, thread-safe) and answered
  through an asyncio future (`call_soon_threadsafe`). Measured on loopback: about 0.04 ms per call, 0.05 ms
  added to a 2.3 KB echo round trip; trio's guest mode on the asyncio loop added 0.35 ms (its I/O waits
  hop threads), and `run_in_executor` with `trio.from_thread.run` 0.2 ms.
- **Streams.** A trio task per stream reads and feeds an `asyncio.StreamReader`; writes go through a
  per-stream trio lock, in order, so two writers never interleave frames.

This module must not import hivemind: both register `crypto.pb.KeyType` in protobuf's default pool, so
they cannot share a process (a test checks `sys.modules`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Sequence

from client.light.addresses import AddressBook
from swarm.net import record_service
from swarm.errors import ConfigError, ConnectionLost, SwarmError, SwarmUnreachable
from swarm.net.transport import Stream

logger = logging.getLogger(__name__)

READ_BYTES = 1 << 16
STREAM_LIMIT = 1 << 30  # the asyncio reader's buffer limit: wire.read_message enforces the real caps
# bytes read from a stream and not yet taken by its reader, at most: past this the stream is not read (the
# sender is held back by the transport's flow control), so a peer cannot fill the client's memory on a stream
# it is not asked to answer; a stream left full this long is ended
MAX_BUFFERED = 4 * 2**20 + READ_BYTES
FULL_S = 60.0
CONNECT_TIMEOUT = 10.0
MAX_SOURCES_KNOWN = 64


def split_maddr(maddr: str) -> tuple[str, str]:
    """(address without /p2p, peer id) of a full multiaddr `/ip4/.../tcp/.../p2p/<id>`."""
    head, sep, peer = maddr.rpartition("/p2p/")
    if not sep or not peer or "/" in peer:
        raise ConfigError(f"{maddr!r} is not a multiaddr ending in /p2p/<peer id>")
    return head, peer


class _Writer:
    """The asyncio side of a stream's writing half: what `wire.write_message` and `Stream.aclose` call."""

    def __init__(self, node: LightNode, stream, lock):
        self.node, self.stream, self.lock = node, stream, lock
        self.pending: list[bytes] = []
        self.closed = False

    def write(self, data) -> None:
        if self.closed:
            raise ConnectionResetError("the stream is closed")
        self.pending.append(bytes(data))

    async def drain(self) -> None:
        if not self.pending:
            return
        data, self.pending = b"".join(self.pending), []

        async def write():
            async with self.lock:
                await self.stream.write(data)

        try:
            await self.node.call(write)
        except SwarmError:
            raise
        except Exception as e:  # a reset or closed stream, in libp2p's own exception types
            raise ConnectionResetError(f"write failed: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._closing = self.node.call_soon(self.stream.close)

    async def wait_closed(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closing, 2.0)


class LightNode:
    """`async with LightNode(initial_peers) as node:` a libp2p host in a trio thread (see the module docstring)."""

    def __init__(self, initial_peers: Sequence[str], records_timeout: float = 10.0):
        if not initial_peers:
            raise ConfigError("no initial peers: give the multiaddr of the swarm's bootstrap node or of any peer")
        self.initial = [split_maddr(m) for m in initial_peers]
        self.records_timeout = records_timeout
        self.addrs = AddressBook(self.initial)  # where each peer is, on trial (`client.light.addresses`)
        self.sources: list[str] = list(dict.fromkeys(peer for _, peer in self.initial))  # initial peers first
        self.peer_id = ""
        self.dials_relays = False  # it dials direct addresses only: peers reached through a relay are not routed to
        self.refused = 0  # records that failed their checks, over every read
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token = self._nursery = self._host = self._stop = None
        self._connecting: dict[str, asyncio.Future] = {}

    # ---- the trio thread ----

    async def __aenter__(self) -> LightNode:
        self._loop = asyncio.get_running_loop()
        ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run_trio, args=(ready,), name="swarm-libp2p", daemon=True)
        self._thread.start()
        await asyncio.wait_for(ready, 60)
        # reach an initial peer before going on, as a DHT node joins before it serves
        errors = []
        for peer in self.sources:
            try:
                await self._connect(peer)
                return self
            except SwarmError as e:
                errors.append(str(e))
        await self.__aexit__(None, None, None)
        raise SwarmUnreachable(f"no initial peer answered: {'; '.join(errors)}")

    def _run_trio(self, ready: asyncio.Future) -> None:
        import trio

        async def main():
            from client.light.host import ClientHost

            host = ClientHost()
            async with host.run(), trio.open_nursery() as nursery:
                self._host, self._nursery = host, nursery
                self._token, self._stop = trio.lowlevel.current_trio_token(), trio.Event()
                self.peer_id = str(host.id)
                self._loop.call_soon_threadsafe(_resolve, ready, None)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 - reported to the asyncio side, whatever it is
            self._loop.call_soon_threadsafe(_fail, ready, e)
            logger.debug("libp2p thread ended: %r", e)

    async def __aexit__(self, *exc) -> None:
        if self._token is not None:
            with contextlib.suppress(Exception):  # trio already gone
                self._token.run_sync_soon(self._stop.set)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self._token = None

    def call_soon(self, afn, *args) -> asyncio.Future:
        """Run `afn(*args)` in trio; its result (or error) comes back as an asyncio future."""
        loop, fut = self._loop, self._loop.create_future()
        if self._token is None:
            fut.set_exception(ConnectionLost("the libp2p host has stopped"))
            return fut

        async def runner():
            try:
                result = await afn(*args)
            except BaseException as e:  # noqa: BLE001 - every error goes back to the caller
                loop.call_soon_threadsafe(_fail, fut, e)
            else:
                loop.call_soon_threadsafe(_resolve, fut, result)

        try:
            self._token.run_sync_soon(self._nursery.start_soon, runner)
        except RuntimeError:  # trio has exited
            fut.set_exception(ConnectionLost("the libp2p host has stopped"))
        return fut

    async def call(self, afn, *args):
        return await self.call_soon(afn, *args)

    # ---- connections and streams ----

    async def _connect(self, peer: str) -> None:
        """A connection to `peer` through one of the addresses known for it (tried in order; one that fails is
        dropped, one that connects goes first). Callers that come while a connect is under way wait for it; if
        its caller is cancelled, they get `ConnectionLost` (and may try again), never a wait without end."""
        if peer in self._connecting:
            return await asyncio.shield(self._connecting[peer])
        addrs = self.addrs.get(peer)
        if not addrs:
            raise ConnectionLost(f"no address known for peer …{peer[-8:]}")
        fut = self._connecting[peer] = self._loop.create_future()
        errors = []
        try:
            for addr in addrs:
                try:
                    await asyncio.wait_for(self.call(_dial, self._host, f"{addr}/p2p/{peer}"), CONNECT_TIMEOUT)
                    self.addrs.connected(peer, addr)
                    fut.set_result(None)
                    return
                except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - libp2p's own error types
                    self.addrs.failed(peer, addr)
                    errors.append(f"{addr}: {type(e).__name__}: {e}"[:200])
            error = ConnectionLost(f"cannot connect to peer …{peer[-8:]}: {'; '.join(errors)}")
            fut.set_exception(error)
            fut.exception()  # read here: callers that wait on it get it raised
            raise error
        finally:
            self._connecting.pop(peer, None)
            if not fut.done():  # its caller was cancelled: whoever waits on it tries again
                fut.set_exception(ConnectionLost(f"connecting to peer …{peer[-8:]} was cancelled; try again"))
                fut.exception()

    async def open(self, peer: str, protocol: str) -> Stream:
        """A new stream to `peer`; `ConnectionLost` if the peer cannot be reached or refuses the protocol."""
        if self._token is None:
            raise ConnectionLost("the libp2p host has stopped")
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=self._loop)
        try:
            try:
                stream, lock = await self.call(_new_stream, self, peer, protocol, reader)
            except Exception as first:  # noqa: BLE001 - not connected yet (or dropped): connect, then once more
                if isinstance(first, SwarmError) and not isinstance(first, ConnectionLost):
                    raise
                await self._connect(peer)
                stream, lock = await self.call(_new_stream, self, peer, protocol, reader)
        except SwarmError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ConnectionLost(f"cannot open {protocol} to peer …{peer[-8:]}: {type(e).__name__}: {e}") from None
        return Stream(reader, _Writer(self, stream, lock), peer)

    def _feed(self, reader: asyncio.StreamReader, data: bytes | None) -> None:
        """From trio: bytes read from a stream (None: its end)."""
        def feed():
            if data is None:
                reader.feed_eof()
            else:
                reader.feed_data(data)

        with contextlib.suppress(RuntimeError):  # the asyncio loop has closed
            self._loop.call_soon_threadsafe(feed)

    # ---- records ----

    async def get_records(self, keys: Sequence[str]) -> dict[str, dict[str, tuple[bytes, float]]]:
        """The checked records under `keys` from at least two sources when two are known: the initial peers
        first, then peers learned from earlier replies (in random order)."""
        initial = [p for p in self.sources if p in {peer for _, peer in self.initial}]
        learned = [p for p in self.sources if p not in initial]
        random.shuffle(learned)
        found = await record_service.read(self, initial + learned, list(keys), self.records_timeout)
        for peer, addrs in found.addrs.items():
            self.addrs.heard(peer, addrs)
        signers = {sub for subs in found.kept.values() for sub in subs}
        for peer in signers:
            if peer not in self.sources and len(self.sources) < MAX_SOURCES_KNOWN:
                self.sources.append(peer)
        if found.refused:
            self.refused += found.refused
            logger.warning("refused %d records that failed their checks", found.refused)
        return found.values()


async def _dial(host, maddr: str) -> None:
    await host.connect(maddr)


async def _new_stream(node: LightNode, peer: str, protocol: str, reader: asyncio.StreamReader):
    """In trio: a stream to `peer` on `protocol`, with a task feeding what it reads to `reader`."""
    import trio

    stream = await node._host.new_stream(peer, protocol)

    async def pump():
        try:
            while True:
                with trio.fail_after(FULL_S):  # trio.TooSlowError ends the stream below
                    while buffered(reader) > MAX_BUFFERED:
                        await trio.sleep(0.005)  # until the reader takes some
                data = await stream.read(READ_BYTES)
                if not data:
                    break
                node._feed(reader, data)
        except trio.TooSlowError:
            logger.info("stream %s to …%s ended: %d bytes unread for %.0f s", protocol, peer[-8:], buffered(reader),
                        FULL_S)
            with contextlib.suppress(Exception):
                await stream.reset()
        except Exception as e:  # noqa: BLE001 - end of stream, reset, closed: all end the reader
            logger.debug("stream %s to …%s ended: %r", protocol, peer[-8:], e)
        node._feed(reader, None)

    node._nursery.start_soon(pump)
    return stream, trio.Lock()


def buffered(reader: asyncio.StreamReader) -> int:
    """Bytes fed to `reader` and not read yet (its buffer's length: read from this thread, a snapshot is enough)."""
    return len(reader._buffer)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error if isinstance(error, Exception) else ConnectionLost(f"libp2p: {error!r}"))


__all__ = ["LightNode"]
