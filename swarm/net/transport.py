"""The one module that talks to hivemind: a DHT node and libp2p streams behind a small interface.

`Node` (an async context manager) owns a libp2p daemon (p2pd, a child process) and an in-process
Kademlia node on this process's event loop. Everything else in the project uses only its methods:
put/get announcement records, serve a protocol, open a stream to a peer.

Invariants:
- The daemon's identity is our Ed25519 key (`swarm.net.identity`), so the peer id libp2p authenticates
  on every stream is the id that signs our records.
- Every record stored or read by this node passes `records.verify` and a per-node `SequenceGuard`;
  a record failing either is dropped as if it did not exist, alone: the other entries of the same
  DHT value (other peers' records under that key) are kept. hivemind's validator API is per record,
  but its protocol refuses a whole dictionary value (a node's reply to a read, or a value replicated
  to us) when one entry fails (`DHTProtocol._validate_dictionary`). Our node's protocol validates
  such a value entry by entry instead (`_validate_entries`), so a record that only one reader refuses
  (an older one of the same peer after that reader saw a newer one, or one skewed clocks put out of
  range) costs that reader that one peer's record, never the rest of the reply. We filter there, and
  not after a raw read, because hivemind merges the replies per subkey by latest expiration: a bad
  entry let through to the merge could displace a good one of the same subkey.
- The daemon never outlives this process: clean exit shuts it down; any other death of this
  process is caught by a reaper process holding a pipe from us (`swarm.net.reaper`).
- Stopping is bounded (`STOP_*` seconds per stage) and leaves no task of the transport behind: the DHT
  unregisters from the daemon while it runs, the daemon is stopped (killed if it lingers), then the
  tasks of hivemind's daemon client are cancelled and awaited, so their errors are collected here and
  never reported by the event loop as "never retrieved".
- The daemon can die before us (a signal sent to our whole process group reaches it too; a crash).
  hivemind's daemon client leaves a call waiting forever for a reply that can no longer come (its
  reader ends on the closed connection and fails nobody). So once the daemon has exited, every call
  waiting for it, and every later one, fails at once (`_RefusedCalls`): hivemind's DHT searches then
  end as they do when peers do not answer, with nothing to cancel (cancelling one midway leaves
  hivemind's waiting tasks pending forever), and our own DHT calls fail fast with `SwarmError`.
- hivemind's package `__init__` imports torch; DHT-only processes (the bootstrap) must not. We load
  hivemind's torch-free submodules directly (see `_load_hivemind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarm.net import records, reaper
from swarm.errors import ConfigError, ConnectionLost, SwarmError, SwarmUnreachable
from swarm.net.identity import Identity, PeerId

logger = logging.getLogger(__name__)

MAX_STORED_VALUE = records.MAX_VALUE_BYTES + 16  # msgpack framing of the envelope
# Stopping, per stage (seconds). Measured on loopback, all the stages together take about 20 ms; the bounds
# only matter when something hangs.
STOP_DHT_S = 1.0  # the DHT removes its handlers from the daemon
STOP_DAEMON_S = 2.0  # the daemon exits after SIGTERM, else it is killed
STOP_TASKS_S = 1.0  # hivemind's client tasks end once cancelled


def _load_hivemind() -> types.SimpleNamespace:
    """hivemind's DHT and P2P classes, without executing hivemind's package __init__ (torch).

    If hivemind was already imported normally, its modules are used as they are.
    """
    if "hivemind" not in sys.modules:
        root = importlib.util.find_spec("hivemind").submodule_search_locations[0]
        for name, sub in (("hivemind", ""), ("hivemind.utils", "/utils"), ("hivemind.dht", "/dht")):
            mod = types.ModuleType(name)
            mod.__path__, mod.__package__ = [root + sub], name
            sys.modules[name] = mod
        from hivemind.utils import logging as hm_logging, serializer, timed_storage

        utils = sys.modules["hivemind.utils"]
        utils.get_logger, utils.get_dht_time = hm_logging.get_logger, timed_storage.get_dht_time
        utils.MSGPackSerializer, utils.SerializerBase = serializer.MSGPackSerializer, serializer.SerializerBase
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
    from hivemind.utils.serializer import MSGPackSerializer

    return types.SimpleNamespace(DHTNode=DHTNode, DHTID=DHTID, DHTRecord=DHTRecord,
                                 RecordValidatorBase=RecordValidatorBase, P2P=P2P,
                                 P2PDaemonError=P2PDaemonError,
                                 P2PHandlerError=P2PHandlerError, PeerID=PeerID, MSGPackSerializer=MSGPackSerializer)


@functools.cache
def _hm() -> types.SimpleNamespace:
    return _load_hivemind()


@functools.lru_cache(maxsize=65536)
def key_id(key: str) -> bytes:
    """The id under which the DHT stores `key` (what records are signed over; `records.key_id`)."""
    return records.key_id(key)


def _make_validator(counters: dict[str, int]):
    hm = _hm()

    class AnnouncementValidator(hm.RecordValidatorBase):
        """Applies `records.verify` and the sequence guard to every record stored or read."""

        def __init__(self):
            self.guard = records.SequenceGuard()

        def validate(self, record) -> bool:
            now = time.time()
            try:
                if len(record.value) > MAX_STORED_VALUE or len(record.subkey) > 128:
                    raise records.RecordRejected("oversize value or subkey")
                subkey = hm.MSGPackSerializer.loads(record.subkey)
                value = hm.MSGPackSerializer.loads(record.value)
                ann = records.verify(record.key, subkey, value, record.expiration_time, now, key_id)
                self.guard.admit(record.key, subkey, ann.seq, value, record.expiration_time, now)
            except Exception as e:  # boundary: anything wrong with an outside record means "reject it"
                counters["rejected"] += 1
                logger.debug("rejected a record: %s", e)
                return False
            counters["accepted"] += 1
            return True

    return AnnouncementValidator()


def _validate_entries(protocol, key: bytes, dictionary) -> bool:
    """hivemind's `DHTProtocol._validate_dictionary`, entry by entry: removes from `dictionary` each
    entry the protocol's validator refuses and keeps the rest; False only if it refused every entry."""
    with dictionary.freeze():
        refused = [subkey for subkey, (value, expiration) in dictionary.items()
                   if not protocol.record_validator.validate(
                       _hm().DHTRecord(key, protocol.serializer.dumps(subkey), value, expiration))]
    for subkey in refused:
        del dictionary[subkey]
    return bool(dictionary) or not refused


@dataclass
class Stream:
    """One bidirectional byte stream to a remote peer, authenticated as `remote`."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    remote: PeerId

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):  # the other side may already be gone; closing is best effort
            await self.writer.wait_closed()


Handler = Callable[[Stream], Awaitable[None]]


class _RefusedCalls(dict):
    """hivemind's table of calls waiting for a reply from the daemon (call id -> future), once the daemon
    has exited: each call in it, and each call added later, fails at once with `P2PDaemonError`."""

    def __init__(self, waiting: dict, reason: str):
        super().__init__(waiting)
        self.reason = reason
        for future in waiting.values():
            self._fail(future)

    def __setitem__(self, call_id, future) -> None:
        super().__setitem__(call_id, future)
        self._fail(future)

    def _fail(self, future: asyncio.Future) -> None:
        if not future.done():
            future.set_exception(_hm().P2PDaemonError(self.reason))


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


class Node:
    """A DHT node with a libp2p daemon. `async with Node(...) as node:`; see the module docstring."""

    def __init__(self, identity: Identity, *, identity_path: str | Path | None = None, host: str = "127.0.0.1",
                 port: int = 0, announce_host: str | None = None, announce_port: int | None = None,
                 initial_peers: Sequence[str] = (),
                 client_mode: bool = False, dht_wait_timeout: float = 3.0):
        self.identity = identity
        self.peer_id = identity.peer_id
        self._identity_path = Path(identity_path) if identity_path else None
        self.host, self.port, self.announce_host, self.announce_port = host, port, announce_host, announce_port
        self.initial_peers = list(initial_peers)
        self.client_mode = client_mode
        self.dht_wait_timeout = dht_wait_timeout
        self.counters = {"accepted": 0, "rejected": 0}
        self._p2p = self._dht = self._reaper = None
        self._daemon_exit: asyncio.Task | None = None  # done once the daemon process has exited
        self._stopping = False

    async def __aenter__(self) -> Node:
        hm = _hm()
        for addr in self.initial_peers:
            if "/p2p/" not in addr or not addr.startswith("/"):
                raise ConfigError(f"initial peer {addr!r} is not a full multiaddr like "
                                  "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...")
        if self.announce_host and not (self.port or self.announce_port):
            raise ConfigError("--announce-host needs a fixed --port (or --announce-port): the announced address must "
                              "be reachable")
        with tempfile.TemporaryDirectory(prefix="swarm-id-") as tmp:
            key_path = self._identity_path
            if key_path is None:  # ephemeral identity: the daemon reads the file at start only
                key_path = Path(tmp) / "identity.key"
                self.identity.save(key_path)
            loopback = _is_loopback(self.host)
            announce = None
            if self.announce_host or self.announce_port:
                announce = [f"/ip4/{self.announce_host or self.host}/tcp/{self.announce_port or self.port}"]
            try:
                self._p2p = await hm.P2P.create(
                    initial_peers=self.initial_peers or None, host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"],
                    announce_maddrs=announce, identity_path=str(key_path), check_if_identity_free=False,
                    auto_nat=not loopback, nat_port_map=not loopback,
                    dht_mode="client" if self.client_mode else "server")
            except hm.P2PDaemonError as e:
                if "bootstrap" in str(e):
                    raise SwarmUnreachable(f"cannot reach any initial peer ({', '.join(self.initial_peers)}); is the "
                                           "bootstrap node running and reachable?") from None
                raise SwarmError(f"the transport daemon failed to start on {self.host}:{self.port}: {e}") from None
        self._daemon_exit = asyncio.create_task(self._p2p._child.wait(), name="transport daemon exit")
        self._daemon_exit.add_done_callback(self._on_daemon_exit)
        try:
            self._reaper = subprocess.Popen([sys.executable, "-S", reaper.__file__, str(self._p2p._child.pid)],
                                            stdin=subprocess.PIPE)
            if str(self._p2p.peer_id) != self.peer_id:
                raise RuntimeError(f"transport daemon runs as {self._p2p.peer_id}, expected {self.peer_id}")
            try:
                self._dht = await hm.DHTNode.create(
                    p2p=self._p2p, initial_peers=self.initial_peers or None, client_mode=self.client_mode,
                    record_validator=_make_validator(self.counters), wait_timeout=self.dht_wait_timeout,
                    cache_locally=False, cache_nearest=0)
            except RuntimeError as e:  # hivemind's way of saying no initial peer answered
                raise SwarmUnreachable(f"none of the initial peers answered ({e}); is the bootstrap node running "
                                       f"and reachable at {', '.join(self.initial_peers)}?") from None
            self._dht.protocol._validate_dictionary = functools.partial(_validate_entries, self._dht.protocol)
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Stop in order, each stage bounded: the DHT (while the daemon can still hear it), the daemon, the
        daemon client's tasks, the reaper. Never raises: whatever fails here, the next stage still runs."""
        self._stopping = True
        if self._dht is not None:
            with contextlib.suppress(Exception):  # best effort: the daemon forgets the handlers when it exits
                await asyncio.wait_for(self._dht.shutdown(), STOP_DHT_S)
            self._dht.is_alive = False  # ends its background loops even if its shutdown did not finish
            self._dht = None
        if self._p2p is not None:
            await self._stop_daemon()
            await self._collect_client_tasks()
        if self._daemon_exit is not None:
            self._daemon_exit.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome is only the exit code
                await self._daemon_exit
            self._daemon_exit = None
        self._p2p = None
        if self._reaper is not None:
            self._reaper.stdin.close()  # end of file: the reaper finds the daemon gone and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.get_running_loop().run_in_executor(None, self._reaper.wait, STOP_DAEMON_S + 1)
            self._reaper = None

    async def _stop_daemon(self) -> None:
        """SIGTERM the daemon (hivemind's shutdown also closes its client) and wait for it; kill it if it lingers."""
        child = self._p2p._child
        with contextlib.suppress(Exception):  # a daemon that is gone already cannot be stopped twice
            await asyncio.wait_for(self._p2p.shutdown(), STOP_DAEMON_S)
        if child.returncode is None:
            logger.warning("the transport daemon (pid %d) did not exit within %.0f s of SIGTERM: killing it",
                           child.pid, STOP_DAEMON_S)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), STOP_DAEMON_S)

    async def _collect_client_tasks(self) -> None:
        """Cancel and await the tasks of hivemind's daemon client. Once the daemon is gone they fail on its
        closed sockets; awaited here, their errors are expected and logged, not left to the event loop."""
        p2p = self._p2p
        control = getattr(p2p._client, "control", None)
        tasks = [p2p._reader_task, p2p._listen_task]
        if control is not None:
            tasks += [control._read_task, control._write_task, *control._handler_tasks.values()]
        tasks = [t for t in tasks if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TASKS_S)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.debug("transport task %s ended with %r", task.get_name(), task.exception())

    def _on_daemon_exit(self, exit_task: asyncio.Task) -> None:
        """The daemon is gone: calls waiting for its replies, and later ones, fail (see the module docstring)."""
        if exit_task.cancelled():
            return
        code = exit_task.result()
        if self._stopping:
            logger.debug("the transport daemon exited (code %s)", code)
        else:
            logger.warning("the transport daemon exited (code %s): this node is offline", code)
        control = getattr(self._p2p._client, "control", None) if self._p2p is not None else None
        if control is not None:
            control._pending_calls = _RefusedCalls(control._pending_calls, f"the transport daemon exited (code {code})")

    def _check_daemon(self) -> None:
        if self._daemon_exit is None or self._daemon_exit.done():
            raise SwarmError("the transport daemon is not running: this node is offline; restart it")

    @property
    def daemon_pid(self) -> int | None:
        return self._p2p._child.pid if self._p2p is not None else None

    async def maddrs(self) -> list[str]:
        """Full multiaddrs others can use as initial peers: /ip4/.../tcp/.../p2p/<peer id>."""
        out = []
        for addr in map(str, await self._p2p.get_visible_maddrs()):
            out.append(addr if "/p2p/" in addr else f"{addr}/p2p/{self.peer_id}")
        return out

    def routing_table_size(self) -> int:
        return len(self._dht.protocol.routing_table.peer_id_to_uid)

    async def connected_peers(self) -> int:
        return len(await self._p2p.list_peers())

    async def peer_addrs(self) -> dict[str, list[str]]:
        """Addresses of the peers this node is connected to, and its own: {peer id: [multiaddr, ...]} (without
        the /p2p part). What a records reply tells a reader that has no DHT to find them with."""
        out = {str(info.peer_id): [str(a) for a in info.addrs] for info in await self._p2p.list_peers()}
        out[self.peer_id] = [str(a) for a in await self._p2p.get_visible_maddrs()]
        return out

    # ---- records ----

    async def put_records(self, items: Sequence[tuple[str, str, bytes, float]]) -> dict[tuple[str, str], bool]:
        """Store (key, subkey, value, expiration) items; returns whether each was stored anywhere."""
        if not items:
            return {}
        keys, subkeys, values, expirations = zip(*items)
        self._check_daemon()
        ok = await self._dht.store_many(list(keys), list(values), list(expirations), subkeys=list(subkeys))
        return {k: bool(v) for k, v in ok.items()}

    async def get_records(self, keys: Sequence[str]) -> dict[str, dict[str, tuple[bytes, float]]]:
        """For each key: {subkey: (value, expiration)} of the valid, unexpired records found (latest)."""
        self._check_daemon()
        found = await self._dht.get_many(list(keys), sufficient_expiration_time=float("inf"))
        out: dict[str, dict[str, tuple[bytes, float]]] = {}
        for key in keys:
            entry = found.get(key)
            value = entry.value if entry is not None else None
            out[key] = {sub: (item.value, item.expiration_time) for sub, item in value.items()
                        if isinstance(sub, str) and isinstance(item.value, bytes)} if isinstance(value, dict) else {}
        return out

    # ---- streams ----

    async def serve(self, protocol: str, handler: Handler) -> None:
        async def on_stream(info, reader, writer):
            stream = Stream(reader, writer, PeerId(str(info.peer_id)))
            try:
                await handler(stream)
            except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                logger.debug("stream %s from %s ended: %r", protocol, describe_peer(stream.remote), e)
            except Exception:  # boundary: one broken stream must never take the node down
                logger.exception("handler for %s from %s failed", protocol, describe_peer(stream.remote))
            finally:
                await stream.aclose()

        await self._p2p.add_binary_stream_handler(protocol, on_stream)

    async def open(self, peer: PeerId, protocol: str) -> Stream:
        """A new stream to `peer`; `ConnectionLost` if the peer cannot be reached or refuses the protocol."""
        try:
            peer_id = _hm().PeerID.from_base58(peer)
        except (ValueError, TypeError, UnicodeError) as e:
            raise ConnectionLost(f"cannot open {protocol} to {str(peer)[:60]!r}: not a peer id ({e})") from None
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, protocol)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, _hm().P2PDaemonError,
                _hm().P2PHandlerError) as e:
            raise ConnectionLost(f"cannot open {protocol} to peer {describe_peer(peer)}: {e}") from None
        return Stream(reader, writer, peer)


def describe_peer(peer: str) -> str:
    """Short form of a peer id for logs: the last 8 characters."""
    return f"…{peer[-8:]}"


__all__ = ["Node", "Stream", "key_id", "describe_peer"]
