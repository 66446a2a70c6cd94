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
  hivemind's torch-free submodules directly (`swarm.net.dht_glue`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarm.net import presence, reach, reaper, relays
from swarm.net.dht_glue import collect_client_tasks, hm as _hm, key_id  # noqa: F401 (key_id: part of this module's interface)
from swarm.net.dht_glue import make_validator as _make_validator, validate_entries as _validate_entries
from swarm.net.known_peers import KnownPeers
from swarm.errors import ConfigError, ConnectionLost, SwarmError, SwarmUnreachable
from swarm.net.identity import Identity, PeerId, describe_peer

logger = logging.getLogger(__name__)

# Stopping, per stage (seconds). Measured on loopback, all the stages together take about 20 ms; the bounds
# only matter when something hangs.
STOP_DHT_S = 1.0  # the DHT removes its handlers from the daemon
STOP_DAEMON_S = 2.0  # the daemon exits after SIGTERM, else it is killed


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


def _with_flags(extra: dict):
    """hivemind's `P2P._make_process_args` with more daemon flags (the relay's limits, static relays)."""
    make = _hm().P2P._make_process_args

    def make_process_args(*args, **kwargs):
        return make(*args, **{**kwargs, **extra})

    return staticmethod(make_process_args)


class Node:
    """A DHT node with a libp2p daemon. `async with Node(...) as node:`; see the module docstring."""

    def __init__(self, identity: Identity, *, identity_path: str | Path | None = None, host: str | None = "127.0.0.1",
                 port: int = 0, announce_host: str | None = None, announce_port: int | None = None,
                 initial_peers: Sequence[str] = (), client_mode: bool = False, dht_wait_timeout: float = 3.0,
                 reachability: str = "auto", relay: reach.RelayLimits | None = None,
                 known_peers: str | Path | None = None, join_alone: bool = False):
        """`host`: where to listen; None: 127.0.0.1 in a swarm on this machine, else all interfaces (clients).
        `reachability`: auto (ask peers to dial back), public or private. `relay`: what this node gives others
        as a relay when public (None: it relays for nobody). `known_peers`: the file of peers met
        (`swarm.net.known_peers`), joined through when no initial peer answers. `join_alone`: with no initial
        peer given and none of the peers met answering, start as the swarm's first node (a bootstrap)."""
        if reachability not in ("auto", reach.PUBLIC, reach.PRIVATE):
            raise ConfigError(f"reachability {reachability!r} must be auto, public or private")
        self.identity = identity
        self.peer_id = identity.peer_id
        self._identity_path = Path(identity_path) if identity_path else None
        self.initial_peers = list(initial_peers)
        self.port, self.announce_host, self.announce_port = port, announce_host, announce_port
        self.host = host if host is not None else "127.0.0.1" if self._all_loopback() else "0.0.0.0"
        self.client_mode = client_mode
        self.dht_wait_timeout = dht_wait_timeout
        self.reachability, self.relay, self.join_alone = reachability, relay, join_alone
        self.known = KnownPeers(Path(known_peers)) if known_peers else None
        self.reach, self.reach_why = reach.UNKNOWN, ""  # how others reach this node (local on one machine)
        self.relays: list[str] = []  # ids of the relays this node is reachable through
        self.relay_checked: bool | None = None  # a public relay: whether its own limits serve (`relays.check`)
        self.counters = {"accepted": 0, "rejected": 0}
        self._p2p = self._dht = self._reaper = self._watch = None
        self._handlers: dict = {}  # protocol -> the daemon's stream handler (registered again after a restart)
        self._replacing: asyncio.Future | None = None  # a restart with new relays (`relays.replace`), if one runs
        self.public_met: dict[str, str] = {}  # public relay candidates that answered: peer -> address (`relays.meet`)
        self._port = port
        self._joined_through: list[str] = list(initial_peers)
        self._daemon_exit: asyncio.Task | None = None  # done once the daemon process has exited
        self._stopping = False
        self._restarting = False  # the daemon is stopped to start again (while joining): its exit is expected

    def _all_loopback(self) -> bool:
        return bool(self.initial_peers) and all(reach.is_loopback_addr(a) for a in self.initial_peers)

    @property
    def local(self) -> bool:
        """A swarm on this machine only: loopback host, or every initial peer on loopback (no probe, no relay)."""
        return _is_loopback(self.host) or self._all_loopback()

    async def __aenter__(self) -> Node:
        hm = _hm()
        for addr in self.initial_peers:
            reach.check_initial_peer(addr, hm.Multiaddr, hm.PeerID.from_base58)
        if self.announce_host and not (self.port or self.announce_port):
            raise ConfigError("--announce-host needs a fixed --port (or --announce-port): the announced address must "
                              "be reachable")
        try:
            if self.local:
                loopback = _is_loopback(self.host)
                self.reach = reach.LOCAL
                await self._start_daemon({"auto_nat": not loopback, "nat_port_map": not loopback}, {},
                                         self.initial_peers)
            else:
                await self._join()
            await self._make_dht()
            if not self.client_mode:
                helper = reach.Helper(self._observed_ip, self.dialable_maddrs, lambda: self.relay_checked,
                                      self.known.load if self.known is not None else dict)
                await self.serve(reach.REACH_PROTOCOL, lambda s: helper.handle(s.reader, s.writer, s.remote))
            if not self.local:
                self._watch = asyncio.create_task(presence.watch(self), name="reachability watch")
        except BaseException:
            await self._stop()
            raise
        return self

    async def _make_dht(self) -> None:
        try:
            self._dht = await _hm().DHTNode.create(
                p2p=self._p2p, initial_peers=self._joined_through or None,
                client_mode=self.client_mode or self.reach == reach.PRIVATE,
                record_validator=_make_validator(self.counters), wait_timeout=self.dht_wait_timeout,
                cache_locally=False, cache_nearest=0)
        except RuntimeError as e:  # hivemind's way of saying no initial peer answered
            raise SwarmUnreachable(f"none of the initial peers answered ({e}); is the bootstrap node running "
                                   f"and reachable at {', '.join(self._joined_through)}?") from None
        self._dht.protocol._validate_dictionary = functools.partial(_validate_entries, self._dht.protocol)

    async def _start_daemon(self, kwargs: dict, extra: dict, initial: Sequence[str]) -> None:
        """Start the daemon (and its reaper) with these `P2P.create` arguments and extra daemon flags."""
        hm = _hm()
        # TCP only: streams over the daemon's QUIC ended without a reply for about half the pairs measured in the
        # box of NAT'd homes (benchmarks/home_routers.py), never over TCP or relayed TCP
        host_maddrs = [f"/ip4/{self.host}/tcp/{self._port}"]
        announce = None
        if self.announce_host or self.announce_port:
            announce = [f"/ip4/{self.announce_host or self.host}/tcp/{self.announce_port or self.port}"]
        p2p_class = self.p2p_class(extra)
        self._settings = (kwargs, extra)
        with tempfile.TemporaryDirectory(prefix="swarm-id-") as tmp:
            key_path = self._identity_path
            if key_path is None:  # ephemeral identity: the daemon reads the file at start only
                key_path = Path(tmp) / "identity.key"
                self.identity.save(key_path)
            try:
                with relays.ours_last(extra.get("relayService") == 1):
                    self._p2p = await p2p_class.create(
                        initial_peers=list(initial) or None, host_maddrs=host_maddrs, announce_maddrs=announce,
                        identity_path=str(key_path), check_if_identity_free=False,
                        dht_mode="client" if self.client_mode else "server", **kwargs)
            except hm.P2PDaemonError as e:
                if "bootstrap" in str(e):
                    raise SwarmUnreachable(f"cannot reach any initial peer ({', '.join(initial)}); is the "
                                           "bootstrap node running and reachable?") from None
                raise SwarmError(f"the transport daemon failed to start on {self.host}:{self._port}: {e}") from None
        self._daemon_exit = asyncio.create_task(self._p2p._child.wait(), name="transport daemon exit")
        self._daemon_exit.add_done_callback(self._on_daemon_exit)
        self._reaper = subprocess.Popen([sys.executable, "-S", reaper.__file__, str(self._p2p._child.pid)],
                                        stdin=subprocess.PIPE)
        if str(self._p2p.peer_id) != self.peer_id:
            raise RuntimeError(f"transport daemon runs as {self._p2p.peer_id}, expected {self.peer_id}")

    @staticmethod
    def p2p_class(extra: dict):
        """The transport daemon's class, started with these extra daemon flags."""
        return type("SwarmP2P", (_hm().P2P,), {"_make_process_args": _with_flags(extra)}) if extra else _hm().P2P

    async def _restart_daemon(self, kwargs: dict | None = None, extra: dict | None = None) -> None:
        """Stop the daemon and start it again with these settings (default: the last ones), while joining."""
        kwargs, extra = (kwargs, extra) if kwargs is not None else self._settings
        await self._stop_for_restart()
        await self._start_daemon(kwargs, extra, self._joined_through)

    async def _join(self) -> None:
        """Join off this machine: through the initial peers, else the peers met before; then find out how this
        node is reached and restart the daemon set for it (a relayed node reserves slots on relays)."""
        self._port = self.port or reach.free_port(self.host)
        given = list(self.initial_peers)
        met = []
        if self.known is not None and (given or self.join_alone):  # a node given no peer starts a swarm of its own
            met = self.known.join_addrs(exclude={reach.peer_of(a) for a in given})
        wanted = self.reachability if self.reachability != "auto" else reach.UNKNOWN
        role = "client" if self.client_mode else wanted
        kwargs, extra = reach.daemon_settings(role, relays=given + met, limits=self.relay)
        failure: SwarmError | None = None
        for initial in [a for a in (given, met) if a]:
            try:
                await self._start_daemon(kwargs, extra, initial)
                self._joined_through = list(initial)
                if initial is met:
                    logger.info("joined through the peers met before (%s)",
                                ", ".join(dict.fromkeys(describe_peer(reach.peer_of(a)) for a in met)))
                break
            except SwarmError as e:  # unreachable; or, for peers met before, an address the daemon refuses
                await self._stop_for_restart()
                if initial is given and not isinstance(e, SwarmUnreachable):
                    raise
                failure = e
                if initial is given and met:
                    logger.warning("no initial peer answered (%s); joining through %d peers met before",
                                   ", ".join(describe_peer(reach.peer_of(a)) for a in given),
                                   len({reach.peer_of(a) for a in met}))
        else:  # nobody to join through, or nobody answered
            if failure is None or (self.join_alone and not given):
                if failure is not None:
                    logger.warning("none of the peers met before answered: starting alone")
                await self._start_daemon(kwargs, extra, [])
                self._joined_through = []
            elif isinstance(failure, SwarmUnreachable):
                raise failure
            else:
                raise SwarmUnreachable(f"no initial peer answered, nor any peer met before ({failure})") from None
        if self.client_mode:
            self.reach = "client"
            return
        if self.reachability != "auto":
            self.reach, self.reach_why = self.reachability, "as configured"
        else:
            self.reach, self.reach_why = await reach.check(self._open_rw, await self.connected_peer_ids(),
                                                           self.announce_port or self._port)
        logger.info("reachability: %s (%s)", self.reach, self.reach_why)
        if self.reach in (reach.PUBLIC, reach.PRIVATE):
            chosen = await relays.choose(self, given + met) if self.reach == reach.PRIVATE else given + met
            if self.reachability == "auto" or chosen != given + met:
                await self._restart_daemon(*reach.daemon_settings(self.reach, relays=chosen, limits=self.relay))
                await relays.meet(self)  # its outside address seen by enough hosts to punch holes
            if self.reach == reach.PUBLIC and self.relay is not None:
                await relays.ensure_own(self, self._restart_daemon)

    async def connected_peer_ids(self) -> list[str]:
        """Ids of the peers this node is connected to, those it joined through first (each once)."""
        connected = list(dict.fromkeys(str(info.peer_id) for info in await self._p2p.list_peers()))
        joined = [p for p in dict.fromkeys(reach.peer_of(a) for a in self._joined_through) if p in connected]
        return list(dict.fromkeys(joined + connected))

    async def dialable_maddrs(self) -> list[str]:
        """The addresses other machines can dial this node at directly: none behind a NAT (it is reached through
        its relays) or on one machine; otherwise its visible addresses but loopback ones."""
        if self.reach in (reach.PRIVATE, reach.LOCAL):
            return []
        addrs = [a for a in await self.maddrs() if reach.dialable(a.split("/p2p/")[0])]
        return [a for a in addrs if reach.is_global_addr(a)] or addrs  # a LAN swarm's addresses when no other

    async def _open_rw(self, peer: str, protocol: str):
        stream = await self.open(PeerId(peer), protocol)
        return stream.reader, stream.writer

    async def _observed_ip(self, peer: str) -> str | None:
        for info in await self._p2p.list_peers():
            if str(info.peer_id) == peer:
                for addr in info.addrs:
                    if (ip := reach.ip_of(str(addr))) is not None:
                        return ip
        return None

    # ---- reachability ----

    @property
    def reached_by(self) -> str | None:
        """What records say of how this node is reached: "relay", "direct", or None (on one machine, unknown)."""
        return {reach.PRIVATE: "relay", reach.PUBLIC: "direct"}.get(self.reach)

    async def __aexit__(self, *exc) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Stop in order, each stage bounded: the DHT (while the daemon can still hear it), the daemon, the
        daemon client's tasks, the reaper. Never raises: whatever fails here, the next stage still runs."""
        self._stopping = True
        if self._replacing is not None and not self._replacing.done():  # it ends with a daemon: then stop that one
            await asyncio.wait([self._replacing], timeout=STOP_DAEMON_S * 6)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome is only logs
                await self._watch
            self._watch = None
        await self._stop_dht()
        await self._stop_transport()

    async def _stop_dht(self) -> None:
        if self._dht is not None:
            dht, self._dht = self._dht, None  # records calls meanwhile fail as offline (`_check_daemon`)
            with contextlib.suppress(Exception):  # best effort: the daemon forgets the handlers when it exits
                await asyncio.wait_for(dht.shutdown(), STOP_DHT_S)
            dht.is_alive = False  # ends its background loops even if its shutdown did not finish

    async def _stop_transport(self) -> None:
        """The daemon, its client's tasks, the reaper (also between two starts of the daemon while joining)."""
        if self._p2p is not None:
            await self._stop_daemon()
            await collect_client_tasks(self._p2p)
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

    async def _stop_for_restart(self) -> None:
        """`_stop_transport`, the daemon's exit expected (not reported as this node going offline)."""
        self._restarting = True
        try:
            await self._stop_transport()
        finally:
            self._restarting = False

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

    def _on_daemon_exit(self, exit_task: asyncio.Task) -> None:
        """The daemon is gone: calls waiting for its replies, and later ones, fail (see the module docstring)."""
        if exit_task.cancelled():
            return
        code = exit_task.result()
        if self._stopping or self._restarting:
            logger.debug("the transport daemon exited (code %s)", code)
        else:
            logger.warning("the transport daemon exited (code %s): this node is offline", code)
        control = getattr(self._p2p._client, "control", None) if self._p2p is not None else None
        if control is not None:
            control._pending_calls = _RefusedCalls(control._pending_calls, f"the transport daemon exited (code {code})")

    def _check_daemon(self) -> None:
        if self._replacing is not None and not self._replacing.done():
            raise SwarmError("the transport daemon is starting again with new relays: try again in a few seconds")
        if self._daemon_exit is None or self._daemon_exit.done() or self._dht is None:
            raise SwarmError("the transport daemon is not running: this node is offline; restart it")

    @property
    def daemon_pid(self) -> int | None:
        return self._p2p._child.pid if self._p2p is not None else None

    async def maddrs(self) -> list[str]:
        """Full multiaddrs others can use as initial peers: /ip4/.../tcp/.../p2p/<peer id>; public ones first,
        then relayed and private ones, loopback last."""
        out = []
        for addr in map(str, await self._p2p.get_visible_maddrs(latest=True)):
            out.append(addr if "/p2p/" in addr else f"{addr}/p2p/{self.peer_id}")
        return sorted(out, key=lambda a: (reach.is_loopback_addr(a), reach.is_private_addr(a), "/p2p-circuit" in a))

    def routing_table_size(self) -> int:
        return len(self._dht.protocol.routing_table.peer_id_to_uid)

    async def connected_peers(self) -> int:
        return len(await self._p2p.list_peers())

    async def peer_addrs(self) -> dict[str, list[str]]:
        """Addresses of the peers this node is connected to, and its own: {peer id: [multiaddr, ...]} (without
        the /p2p part). What a records reply tells a reader that has no DHT to find them with."""
        out = {str(info.peer_id): [str(a) for a in info.addrs] for info in await self._p2p.list_peers()}
        out[self.peer_id] = [str(a) for a in await self._p2p.get_visible_maddrs(latest=True)]
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

        self._handlers[protocol] = on_stream
        await self._p2p.add_binary_stream_handler(protocol, on_stream)

    async def open(self, peer: PeerId, protocol: str) -> Stream:
        """A new stream to `peer`; `ConnectionLost` if the peer cannot be reached or refuses the protocol."""
        try:
            peer_id = _hm().PeerID.from_base58(peer)
        except (ValueError, TypeError, UnicodeError) as e:
            raise ConnectionLost(f"cannot open {protocol} to {str(peer)[:60]!r}: not a peer id ({e})") from None
        try:
            if self._p2p is None:
                raise ConnectionError("this node's transport daemon is starting again")
            _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, protocol)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, _hm().P2PDaemonError,
                _hm().P2PHandlerError) as e:
            raise ConnectionLost(f"cannot open {protocol} to peer {describe_peer(peer)}: {e}{relays.refusal(str(e))}") \
                from None
        return Stream(reader, writer, peer)




__all__ = ["Node", "Stream", "key_id", "describe_peer"]
