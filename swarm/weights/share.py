"""Peers give weight files to each other over `wire.WEIGHTS_PROTOCOL` (docs/protocol.md): the server side
(`FileShare`, whose `handler` a peer registers with `node.serve`) and the client side (`find_holders`,
`fetch_file`). Torch-free.

Trust: a holder is a source, never an authority. A file is named by the sha256 of its bytes, known
beforehand (from the model hub), and a downloaded file is renamed into place only once its whole sha256
matches. A holder that sent every byte of a file that does not match is banned (added to the caller's
`banned`); when the bytes came from several sources (a partial file resumed, a holder that broke off),
the bytes before the last holder's are fetched again from it and compared, so a wrong file never
bans an honest holder for another's bytes: if the file then matches, whoever sent differing bytes is
banned, and if it does not, the last holder (who by then sent every byte) is.

Invariants:
- The server never reads a file faster than the network takes it: each chunk is read from disk only
  after the previous one was handed to the transport (`drain`), so a slow reader costs it one chunk of
  memory, and a reader that takes nothing for `stall_timeout` seconds loses the stream and its slot.
- The bandwidth cap (`rate`) is one token bucket over every transfer of the peer.
- Every loop is bounded: requests per stream, bytes per request, chunks per request (each carries at least
  one byte), attempts per holder (at most two per file), and the time of each (a silence of `timeout`,
  a piece slower than `min_rate`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import (BadRequest, Busy, ConfigError, ConnectionLost, NotServing, ProtocolError, StepTimeout,
                          SwarmError, WeightsUnavailable)
from swarm.net import messages as net_messages, wire
from swarm.net.calls import decode_reply, receive
from swarm.net.identity import PeerId
from swarm.net.transport import Stream
from swarm.weights import messages
from swarm.weights.partial import PartialFile
from swarm.weights.messages import CHUNK_BYTES, MAX_GET_BYTES, MAX_HAVE, Chunk, End, Get, Have, Held, is_sha256

logger = logging.getLogger(__name__)

MAX_TRANSFERS = 4  # `get`s a peer serves at once; more are answered `busy`
MAX_REQUESTS_PER_STREAM = 4096  # a 1 TiB file in `MAX_GET_BYTES` pieces
IDLE_TIMEOUT_S = 30.0  # a stream waits this long for its client's next request
STALL_TIMEOUT_S = 60.0  # a transfer whose client takes nothing for this long is dropped
MIN_RATE = 1024  # bytes/s: the lowest cap `rate` takes
MIN_BURST = 4096  # the bucket's burst (and the chunk size under a cap): a tenth of a second of the rate,
# within [MIN_BURST, CHUNK_BYTES]
MAX_ASKS = 16  # `have` requests `find_holders` has in flight at once
FETCH_TIMEOUT_S = 30.0  # a holder silent this long while a client waits is skipped
MIN_FETCH_RATE = 128 * 1024  # bytes/s: a holder slower than this over a piece is skipped
START_S = 10.0  # what a piece may take beyond its length at `min_rate`: the holder's start


def _check_name(sha256: str) -> str:
    """A sha256 given by the caller (not by a remote party): a wrong one is a `ValueError`."""
    if not is_sha256(sha256):
        raise ValueError(f"a weight file is named by its sha256 in lowercase hex, got {str(sha256)[:80]!r}")
    return sha256


# ---- the bandwidth cap ----

class TokenBucket:
    """`rate` bytes/s on average over everything that takes from it, bursts of at most `burst` bytes.

    `reserve(n)` takes the tokens of `n` bytes at once, into debt if need be, and says how long to wait
    before sending them: concurrent transfers queue behind each other's debt, and what all of them send
    within any time `t` stays below `burst + rate * t`."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= MIN_RATE):
            raise ConfigError(f"a bandwidth cap must be at least {MIN_RATE} bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else min(CHUNK_BYTES, max(MIN_BURST, rate / 10)))
        self.clock = clock
        self.tokens = self.burst
        self.stamp = clock()

    def reserve(self, n: int) -> float:
        """Take `n` bytes' tokens; the seconds to wait before sending them."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        return max(0.0, -self.tokens / self.rate)

    async def take(self, n: int) -> None:
        delay = self.reserve(n)
        if delay > 0:
            await asyncio.sleep(delay)


# ---- the server ----

@dataclass(frozen=True)
class SharedFile:
    path: Path
    size: int


class FileShare:
    """The weight files this peer gives out, keyed by sha256, and the protocol's server.

    `add` only files whose sha256 was verified (others ban this peer for wrong bytes). `enabled` may be
    switched at any time: while False, every request is refused with `not_serving` ("this peer does not
    share weights") and transfers in progress stop at their next chunk. Register with `await node.serve(wire.WEIGHTS_PROTOCOL, share.handler)`."""

    def __init__(self, *, rate: float | None = None, enabled: bool = True, max_transfers: int = MAX_TRANSFERS,
                 idle_timeout: float = IDLE_TIMEOUT_S, stall_timeout: float = STALL_TIMEOUT_S):
        if type(max_transfers) is not int or max_transfers < 1:
            raise ConfigError(f"max_transfers must be a positive integer, got {max_transfers!r}")
        self.enabled = enabled
        self.max_transfers = max_transfers
        self.idle_timeout, self.stall_timeout = idle_timeout, stall_timeout
        self.bucket = TokenBucket(rate) if rate is not None else None
        self.chunk_bytes = int(self.bucket.burst) if self.bucket else CHUNK_BYTES
        self.transfers = 0  # `get`s in progress
        self.stats = {"sent_bytes": 0, "gets": 0, "errors": {}}  # bytes of chunks sent, `get`s completed, refusals
        self._files: dict[str, SharedFile] = {}

    def add(self, sha256: str, path: str | Path, size: int) -> None:
        """Give out the file at `path` (`size` bytes, whose sha256 is `sha256`) from now on."""
        _check_name(sha256)
        path = Path(path)
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{path} is not a file of {size} bytes")
        self._files[sha256] = SharedFile(path, size)

    def remove(self, sha256: str) -> None:
        """Stop giving out `sha256` (a transfer in progress goes on to its end)."""
        self._files.pop(sha256, None)

    @property
    def files(self) -> dict[str, SharedFile]:
        return dict(self._files)

    async def handler(self, stream: Stream) -> None:
        """One stream: any number of requests, one at a time, until the client closes it or is idle."""
        for _ in range(MAX_REQUESTS_PER_STREAM):
            try:
                msg = await asyncio.wait_for(wire.read_message(stream.reader, 0), self.idle_timeout)
            except (EOFError, asyncio.TimeoutError):
                return
            except ProtocolError as e:  # the framing is broken: answer, then close (nothing after it can be read)
                await self._refuse(stream, e)
                return
            try:
                if not self.enabled:
                    raise NotServing("this peer does not share weights")
                if msg.type == messages.HAVE:
                    asked = Have.from_message(msg).sha256s
                    await self._write(stream, Held({s: self._files[s].size for s in asked
                                                    if s in self._files}).to_message())
                elif msg.type == messages.GET:
                    await self._send_range(stream, Get.from_message(msg))
                else:
                    raise BadRequest(f"unknown request {msg.type[:40]!r}: the weights protocol takes "
                                     f"{messages.HAVE!r} and {messages.GET!r}")
            except (BadRequest, NotServing, Busy) as e:
                await self._refuse(stream, e)

    async def _send_range(self, stream: Stream, request: Get) -> None:
        shared = self._files.get(request.sha256)
        if shared is None:
            raise NotServing(f"this peer does not hold {request.sha256}")
        end = request.offset + request.length
        if end > shared.size:
            raise BadRequest(f"bytes [{request.offset}, {end}) are out of range: the file has {shared.size}")
        if self.transfers >= self.max_transfers:
            raise Busy(f"this peer is giving out {self.transfers} files already: ask another")
        self.transfers += 1
        fd = None
        try:
            try:
                fd = await asyncio.to_thread(os.open, shared.path, os.O_RDONLY)
                changed = os.fstat(fd).st_size != shared.size
            except OSError:
                changed = True
            if changed:
                logger.warning("shared weight file %s changed or vanished on disk: no longer given out", shared.path)
                self._files.pop(request.sha256, None)
                raise NotServing(f"this peer no longer holds {request.sha256}")
            pos = request.offset
            while pos < end:  # at most length / chunk_bytes rounds
                if not self.enabled:  # sharing turned off: transfers in progress stop too
                    raise NotServing("this peer stopped sharing weights")
                n = min(self.chunk_bytes, end - pos)
                if self.bucket is not None:
                    await self.bucket.take(n)
                try:
                    data = await asyncio.to_thread(os.pread, fd, n, pos)
                except OSError:
                    data = b""
                if len(data) != n:
                    raise NotServing(f"this peer can no longer read {request.sha256}")
                await self._write(stream, Chunk(data).to_message())
                pos += n
                self.stats["sent_bytes"] += n
            await self._write(stream, End(request.length).to_message())
            self.stats["gets"] += 1
        finally:
            if fd is not None:
                os.close(fd)
            self.transfers -= 1

    async def _write(self, stream: Stream, msg: wire.Message) -> None:
        """Write `msg` once the transport took the previous ones; a client that takes nothing for
        `stall_timeout` seconds loses the stream: what it did not take is dropped, and `TimeoutError` raised."""
        try:
            await asyncio.wait_for(wire.write_message(stream.writer, msg), self.stall_timeout)
        except asyncio.TimeoutError:
            stream.writer.transport.abort()  # a close would wait for the buffered bytes to go out first
            raise

    async def _refuse(self, stream: Stream, error: SwarmError) -> None:
        errors = self.stats["errors"]
        errors[error.code] = errors.get(error.code, 0) + 1
        await self._write(stream, net_messages.Error.of(error).to_message())


# ---- the client ----

async def _open(node, peer: PeerId, timeout: float) -> Stream:
    try:
        return await asyncio.wait_for(node.open(peer, wire.WEIGHTS_PROTOCOL), timeout)
    except asyncio.TimeoutError:
        raise StepTimeout(f"peer {peer} did not open a weights stream within {timeout:.1f} s") from None


async def _send(stream: Stream, msg: wire.Message) -> None:
    try:
        await wire.write_message(stream.writer, msg)
    except (ConnectionError, OSError) as e:
        raise ConnectionLost(f"peer {stream.remote} closed the stream ({type(e).__name__})") from None


async def _held(node, peer: PeerId, sha256s: list[str], timeout: float) -> dict[str, int]:
    stream = await _open(node, peer, timeout)
    try:
        found: dict[str, int] = {}
        for i in range(0, len(sha256s), MAX_HAVE):
            batch = sha256s[i:i + MAX_HAVE]
            await _send(stream, Have(tuple(batch)).to_message())
            held = decode_reply(Held, await receive(stream, timeout, 0), peer, "have")
            found.update((s, held.files[s]) for s in batch if s in held.files)  # names not asked are ignored
        return found
    finally:
        await stream.aclose()


async def find_holders(node, peers: Iterable[PeerId], sha256s: Iterable[str], timeout: float = 10.0,
                       max_asks: int = MAX_ASKS) -> dict[str, list[tuple[PeerId, int]]]:
    """Which of `peers` hold which of the files `sha256s`, and the size each says the file has: {sha256: [(peer,
    size), ...]} with every sha256 asked as a key, holders in the order of `peers`. Peers are asked at most
    `max_asks` at once; each has `timeout` seconds to answer; one that fails, refuses or does not answer in
    time holds nothing. Sizes are the holders' word: keep those equal to the size the hub gives."""
    names = list(dict.fromkeys(map(_check_name, sha256s)))
    peers = list(dict.fromkeys(peers))
    limit = asyncio.Semaphore(max_asks)

    async def ask(peer: PeerId) -> dict[str, int]:
        async with limit:
            try:
                return await asyncio.wait_for(_held(node, peer, names, timeout), timeout)
            except _FAILURES as e:
                logger.info("peer %s did not say which weight files it holds: %s", peer[-8:], _describe(e))
                return {}

    answers = await asyncio.gather(*map(ask, peers)) if names else []
    out: dict[str, list[tuple[PeerId, int]]] = {s: [] for s in names}
    for peer, held in zip(peers, answers):
        for sha256, size in held.items():
            out[sha256].append((peer, size))
    return out


Progress = Callable[[int, int], object]


async def _get(stream: Stream, request: Get, timeout: float, min_rate: float,
               consume: Callable[[int, bytearray], Awaitable[None]]) -> None:
    """Send `request`, hand each chunk of the reply to `consume(offset, data)`, in order, until `end`. The reply
    must come without a silence of `timeout` s and within `START_S + length / min_rate` s in all (at most
    `timeout` for the start)."""
    deadline = time.monotonic() + min(timeout, START_S) + request.length / min_rate
    await _send(stream, request.to_message())
    got = 0
    for _ in range(request.length + 1):  # every chunk carries a byte at least; then `end`
        left = deadline - time.monotonic()
        if left <= 0:
            raise StepTimeout(f"peer {stream.remote} sent {got} of {request.length} bytes slower than "
                              f"{min_rate:.0f} bytes/s")
        msg = await receive(stream, min(timeout, left), CHUNK_BYTES)
        if msg.type == messages.END:
            end = decode_reply(End, msg, stream.remote, "get")
            if end.length != request.length or got != request.length:
                raise ProtocolError(f"peer {stream.remote} ended a get of {request.length} bytes after {got}, "
                                    f"saying {end.length}")
            return
        data = decode_reply(Chunk, msg, stream.remote, "get").data
        if got + len(data) > request.length:
            raise ProtocolError(f"peer {stream.remote} sent more than the {request.length} bytes asked")
        await consume(request.offset + got, data)
        got += len(data)
    raise ProtocolError(f"peer {stream.remote} never ended its reply")  # not reached: `end` or an error comes first


async def _download(node, holder: PeerId, sha256: str, partial: PartialFile, timeout: float, min_rate: float,
                    progress: Progress | None) -> None:
    """Append the bytes after the partial's end from `holder`, in pieces of at most `MAX_GET_BYTES`."""
    async def consume(offset: int, data: bytearray) -> None:
        await asyncio.to_thread(partial.append, data, holder)
        if progress is not None:
            progress(partial.length, partial.size)

    stream = await _open(node, holder, timeout)
    try:
        while partial.length < partial.size:  # at most size / MAX_GET_BYTES pieces: each ends where asked
            piece = Get(sha256, partial.length, min(MAX_GET_BYTES, partial.size - partial.length))
            await _get(stream, piece, timeout, min_rate, consume)
    finally:
        await stream.aclose()


async def _recheck(node, holder: PeerId, sha256: str, partial: PartialFile, upto: int, timeout: float,
                   min_rate: float) -> set[PeerId | None]:
    """Fetch [0, upto) again from `holder`, overwriting what differs; the sources of the bytes that differed."""
    differed: set[PeerId | None] = set()

    async def consume(offset: int, data: bytearray) -> None:
        differed.update(await asyncio.to_thread(partial.replace, offset, data))

    stream = await _open(node, holder, timeout)
    try:
        for offset in range(0, upto, MAX_GET_BYTES):
            await _get(stream, Get(sha256, offset, min(MAX_GET_BYTES, upto - offset)), timeout, min_rate, consume)
    finally:
        await stream.aclose()
    await asyncio.to_thread(partial.rehash, holder)
    return differed


_FAILURES = (SwarmError, OSError, asyncio.TimeoutError)  # a holder's failure (a local disk error included)


def _skip(outcomes: dict[PeerId, str], holder: PeerId, sha256: str, error: BaseException) -> None:
    outcomes[holder] = _describe(error)
    logger.info("peer %s did not deliver weight file %s: %s", holder[-8:], sha256, _describe(error))


def _ban(banned: set[PeerId], outcomes: dict[PeerId, str], peer: PeerId, sha256: str) -> None:
    banned.add(peer)
    outcomes[peer] = "sent wrong bytes: banned"
    logger.warning("peer %s sent wrong bytes of weight file %s: banned", peer[-8:], sha256)


def _describe(error: BaseException) -> str:
    if isinstance(error, SwarmError):
        return f"{error.code}: {error}"
    return f"{type(error).__name__}: {error}"


async def fetch_file(node, holders: Iterable[PeerId], sha256: str, size: int, dest: str | Path, *,
                     banned: set[PeerId], progress: Progress | None = None, timeout: float = FETCH_TIMEOUT_S,
                     min_rate: float = MIN_FETCH_RATE) -> PeerId:
    """Download the file `sha256` of `size` bytes from the first of `holders` that delivers it, into `dest`;
    returns that holder.

    Bytes go to `dest` + ".part" (an existing one is resumed from its length) and the file is renamed to
    `dest` once its sha256 matches. Holders are tried in order, each at most once (twice when its bytes must
    be checked against another's, see the module docstring); those in `banned` are skipped, and a holder
    found sending wrong bytes is added to it. A holder that refuses, is busy, breaks off (what it sent is
    kept), stays silent `timeout` s or sends slower than `min_rate` bytes/s is skipped for this file.
    `progress(bytes_done, size)` is called after each chunk (bytes_done falls back when wrong bytes are
    thrown away). `WeightsUnavailable` when no holder delivers, naming what each did; the partial file is
    kept for the next try. One call per `dest` at a time."""
    _check_name(sha256)
    if type(size) is not int or not 0 <= size <= messages.MAX_FILE_BYTES:
        raise ValueError(f"size must be an integer in [0, {messages.MAX_FILE_BYTES}], got {size!r}")
    dest = Path(dest)
    partial = PartialFile(dest.with_name(dest.name + ".part"), size)
    outcomes: dict[PeerId, str] = {}
    try:
        await asyncio.to_thread(partial.load)
        if progress is not None:
            progress(partial.length, size)
        for holder in dict.fromkeys(holders):
            if holder in banned:
                outcomes.setdefault(holder, "banned")
                continue
            start = partial.length
            try:
                await _download(node, holder, sha256, partial, timeout, min_rate, progress)
            except _FAILURES as e:  # what it sent is kept: the next holder goes on from there
                _skip(outcomes, holder, sha256, e)
                continue
            if partial.hasher.hexdigest() != sha256 and start > 0:  # mixed sources: check the earlier bytes
                try:
                    liars = await _recheck(node, holder, sha256, partial, start, timeout, min_rate)
                except _FAILURES as e:  # the partial is half overwritten: who sent what is lost
                    _skip(outcomes, holder, sha256, e)
                    await asyncio.to_thread(partial.reset)
                    continue
                if partial.hasher.hexdigest() == sha256:
                    for liar in liars - {None}:
                        _ban(banned, outcomes, liar, sha256)
            if partial.hasher.hexdigest() == sha256:
                await asyncio.to_thread(partial.finish, dest)
                return holder
            _ban(banned, outcomes, holder, sha256)  # every byte of the file came from it by now
            await asyncio.to_thread(partial.reset)
            if progress is not None:
                progress(0, size)
        what = "; ".join(f"{peer}: {outcome}" for peer, outcome in outcomes.items()) or "no holder was named"
        raise WeightsUnavailable(f"no peer delivered weight file {sha256} ({size} bytes): {what}", sha256, outcomes)
    finally:
        partial.close()
