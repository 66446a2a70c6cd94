"""hivemind, torch-free: its DHT and P2P classes loaded without its package `__init__` (which imports torch),
and the validator every DHT node of ours applies (see `swarm.net.transport`'s docstring for why entry by entry).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import sys
import time
import types

from swarm.net import records

logger = logging.getLogger("swarm.net.transport")

MAX_STORED_VALUE = records.MAX_VALUE_BYTES + 16  # msgpack framing of the envelope


def load_hivemind() -> types.SimpleNamespace:
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
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.serializer import MSGPackSerializer

    return types.SimpleNamespace(DHTNode=DHTNode, DHTID=DHTID, DHTRecord=DHTRecord,
                                 RecordValidatorBase=RecordValidatorBase, P2P=P2P,
                                 P2PDaemonError=P2PDaemonError,
                                 P2PHandlerError=P2PHandlerError, PeerID=PeerID, MSGPackSerializer=MSGPackSerializer,
                                 Multiaddr=Multiaddr)


@functools.cache
def hm() -> types.SimpleNamespace:
    return load_hivemind()


@functools.lru_cache(maxsize=65536)
def key_id(key: str) -> bytes:
    """The id under which the DHT stores `key` (what records are signed over; `records.key_id`)."""
    return records.key_id(key)


def make_validator(counters: dict[str, int]):
    h = hm()

    class AnnouncementValidator(h.RecordValidatorBase):
        """Applies `records.verify` and the sequence guard to every record stored or read."""

        def __init__(self):
            self.guard = records.SequenceGuard()

        def validate(self, record) -> bool:
            now = time.time()
            try:
                if len(record.value) > MAX_STORED_VALUE or len(record.subkey) > 128:
                    raise records.RecordRejected("oversize value or subkey")
                subkey = h.MSGPackSerializer.loads(record.subkey)
                value = h.MSGPackSerializer.loads(record.value)
                ann = records.verify(record.key, subkey, value, record.expiration_time, now, key_id)
                self.guard.admit(record.key, subkey, ann.seq, value, record.expiration_time, now)
            except Exception as e:  # boundary: anything wrong with an outside record means "reject it"
                counters["rejected"] += 1
                logger.debug("rejected a record: %s", e)
                return False
            counters["accepted"] += 1
            return True

    return AnnouncementValidator()


def validate_entries(protocol, key: bytes, dictionary) -> bool:
    """hivemind's `DHTProtocol._validate_dictionary`, entry by entry: removes from `dictionary` each
    entry the protocol's validator refuses and keeps the rest; False only if it refused every entry."""
    with dictionary.freeze():
        refused = [subkey for subkey, (value, expiration) in dictionary.items()
                   if not protocol.record_validator.validate(
                       hm().DHTRecord(key, protocol.serializer.dumps(subkey), value, expiration))]
    for subkey in refused:
        del dictionary[subkey]
    return bool(dictionary) or not refused


STOP_TASKS_S = 1.0  # hivemind's client tasks end once cancelled


async def collect_client_tasks(p2p) -> None:
    """Cancel and await the tasks of hivemind's daemon client. Once the daemon is gone they fail on its
    closed sockets; awaited here, their errors are expected and logged, not left to the event loop."""
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
