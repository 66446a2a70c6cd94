"""Reading the swarm: who announced what for each block of a model.

Records reaching this point already passed `records.verify` in the transport's validator; here they
are only decoded. Expired records never come back from the DHT.
"""

from __future__ import annotations

from swarm import records
from swarm.transport import Node


async def announcements(node: Node, model_id: str, num_blocks: int) -> dict[int, list[records.Announcement]]:
    """For each block: the announcements stored under it (any state), newest first per peer."""
    keys = [records.block_key(model_id, b) for b in range(num_blocks)]
    found = await node.get_records(keys)
    out: dict[int, list[records.Announcement]] = {}
    for block, key in enumerate(keys):
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
