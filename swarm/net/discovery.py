"""Reading the swarm: who announced what for each block of a model, and which peers of which models
the directory lists.

Records reaching this point already passed `records.verify` in the transport's validator; here they
are only decoded. Expired records never come back from the DHT.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.net import records
from swarm.net.transport import Node


async def announcements(node: Node, model_id: str, num_blocks: int,
                        blocks: Iterable[int] | None = None) -> dict[int, list[records.Announcement]]:
    """For each block (of `blocks`, or all `num_blocks`): the announcements stored under it (any state),
    newest first per peer."""
    blocks = list(range(num_blocks) if blocks is None else blocks)
    keys = [records.block_key(model_id, b) for b in blocks]
    found = await node.get_records(keys)
    out: dict[int, list[records.Announcement]] = {}
    for block, key in zip(blocks, keys):
        anns = []
        for subkey, (value, _expiration) in found.get(key, {}).items():
            try:
                ann = records.Announcement.from_payload(records.open_envelope(value)[1])
            except records.RecordRejected:
                continue  # verified when stored; a record we cannot decode now is simply not used
            if ann.peer == subkey and ann.model == model_id and ann.start <= block < ann.end:
                anns.append(ann)
        out[block] = sorted(anns, key=lambda a: -a.seq)
    return out


def same_weights(anns: dict[int, list[records.Announcement]], digest: str | None) -> dict[int, list[records.Announcement]]:
    """Only the announcements of peers serving exactly the weights `digest` names (all when None): peers
    whose weights differ are never chained, and a record that names no weights is not trusted to match."""
    if digest is None:
        return anns
    newest: dict[str, records.Announcement] = {}
    for block_anns in anns.values():
        for a in block_anns:
            if a.peer not in newest or a.seq > newest[a.peer].seq:
                newest[a.peer] = a
    # a peer's newest record says which weights it has now: its older records (say, of blocks it served
    # before it restarted with other weights) count for nothing
    same = {peer for peer, a in newest.items() if a.digest == digest}
    return {block: [a for a in block_anns if a.peer in same and a.digest == digest]
            for block, block_anns in anns.items()}


async def directory(node: Node) -> list[records.Announcement]:
    """Every peer's directory record (any model, any state): one per peer, sorted by model and span.

    All buckets are read at once; a bucket that nothing returned (empty, or its reply was lost) only
    leaves its peers out."""
    found = await node.get_records(records.DIRECTORY_KEYS)
    anns = []
    for key in records.DIRECTORY_KEYS:
        for subkey, (value, _expiration) in found.get(key, {}).items():
            try:
                ann = records.Announcement.from_payload(records.open_envelope(value)[1])
            except records.RecordRejected:
                continue  # verified when stored; a record we cannot decode now is simply not used
            if ann.peer == subkey and records.directory_key(subkey) == key and ann.num_blocks is not None:
                anns.append(ann)
    return sorted(anns, key=lambda a: (a.model, a.start, a.end, a.peer))
