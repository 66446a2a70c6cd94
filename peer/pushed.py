"""The push protocol's receiving side: steps the previous peer of a client's route pushes into a session here.

A pushed step runs as if its client had sent it, once checked (`PushedSteps.pushable`): the session is open
here, the tag is the one the client made for this step from the pushing peer (any other peer's push is a
forgery), and it is the session's next step. Its result goes to the session's client, on the session's stream:
nothing is answered on the push stream. Whatever cannot run is dropped and counted; the client's deadline makes
it relay the step itself. Bounds: `MAX_PUSHES_PER_SESSION` pushed steps of one session in progress at once,
`MAX_PUSH_TASKS_PER_SESSION` per allowed session in all, and `max_sessions` in compute per push stream.
"""

from __future__ import annotations

import asyncio
import logging
import time

from peer.sessions import ServedSession
from swarm.errors import BadRequest, ProtocolError, SwarmError
from swarm.net import messages, wire
from swarm.net.integrity import tag_ok
from swarm.net.transport import Stream, describe_peer

logger = logging.getLogger(__name__)

PUSH_STEP_WINDOW = 256  # a pushed step id may be at most this far past the session's last (ids skipped by relays)
MAX_PUSHES_PER_SESSION = 2  # pushed steps of one session in progress at once; more are dropped
MAX_PUSH_TASKS_PER_SESSION = 2  # ... and of all sessions, per allowed session


class PushedSteps:
    """Steps pushed into the sessions of `servicer` (a `peer.servicer.Servicer`): its protocol's server side."""

    def __init__(self, servicer):
        self.servicer = servicer
        self.counts = {"received": 0, "dropped": 0, "stale": 0, "rejected": 0, "forged": 0}
        self.tasks: set[asyncio.Task] = set()  # pushed steps in progress

    async def serve(self, stream: Stream) -> None:
        """Read pushed steps and run each in its own task (so they can batch); nothing is answered here:
        each result goes to its session's client, on the session's stream. A stream holds at most
        `max_sessions` pushed steps in compute; one waiting for its client to read holds none."""
        slots = asyncio.Semaphore(self.servicer.config.max_sessions)
        while True:
            try:
                msg = await self.servicer._receive(stream, self.servicer.config.idle_timeout)
            except (EOFError, asyncio.TimeoutError):
                return
            except ProtocolError as e:
                self.servicer._count(e)
                return
            if msg.type != wire.PUSH:
                self.servicer._count(BadRequest())
                logger.info("peer %s sent %r on the push protocol: stream closed", describe_peer(stream.remote),
                            msg.type)
                return
            try:
                push = messages.Push.from_message(msg)
            except BadRequest as e:
                self.servicer._count(e)
                self.counts["rejected"] += 1
                logger.info("peer %s pushed a malformed step: %s", describe_peer(stream.remote), e)
                continue
            session = self.pushable(push, stream.remote)
            if session is None:
                continue
            await slots.acquire()
            session.pushes += 1
            task = asyncio.create_task(self._pushed(session, push.as_step(), slots))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def pushable(self, push: messages.Push, sender: str) -> ServedSession | None:
        """The session a pushed step may run in, or None (counted) if it must be dropped: the session is not
        open here, the tag is not the one the client made for this step from `sender` (the pushing stream's
        authenticated peer: any other peer's push is a forgery), the step is not the session's next one (an
        old id, an id far ahead, a position other than the end of what the session has run: a late duplicate
        or a forgery), or too many pushed steps wait."""
        sid, step, position = push.session, push.step, push.position
        session = self.servicer.sessions.sessions.get(sid)
        if session is None or session.closed or session.send is None:
            self.counts["dropped"] += 1  # closed or reclaimed: the client's deadline makes it relay
            return None
        if not tag_ok(session.push_key, sid, step, sender, push.tag):
            self.counts["forged"] += 1
            logger.info("peer %s pushed step %d of session %s with a wrong tag: dropped", describe_peer(sender), step,
                        sid)
            return None
        if not session.last_step < step <= session.last_step + PUSH_STEP_WINDOW or position != session.end:
            self.counts["stale"] += 1  # the client has already sent a later step itself, or a forgery
            return None
        if session.pushes >= MAX_PUSHES_PER_SESSION or len(self.tasks) >= MAX_PUSH_TASKS_PER_SESSION * \
                self.servicer.config.max_sessions:
            self.counts["dropped"] += 1
            return None
        return session

    async def _pushed(self, session: ServedSession, msg: messages.Step, slots: asyncio.Semaphore) -> None:
        received = time.perf_counter()
        step = msg.step
        self.counts["received"] += 1
        try:
            try:
                reply = await self.servicer._chained_step(session, msg)
            except BadRequest as e:  # the pushing peer's fault, not the client's: drop it, the client relays
                self.servicer._count(e)
                self.counts["rejected"] += 1
                logger.info("pushed step %d of session %s refused: %s", step, session.id, e)
                return
            except SwarmError as e:
                self.servicer._count(e)
                reply = messages.Error.of(e, step).to_message()
            except Exception as e:  # boundary: a bug in one pushed step is reported to its client
                logger.exception("pushed step of session %s failed", session.id)
                self.servicer._count(SwarmError())
                reply = messages.Error.of(SwarmError(f"internal error: {type(e).__name__}"), step).to_message()
        finally:
            slots.release()  # compute is done: a client slow to read holds no slot of the push stream
            session.pushes -= 1
        if await session.send(reply) and reply.type == wire.OUTPUT:
            self.servicer.metrics.step_replied(time.perf_counter() - received)
