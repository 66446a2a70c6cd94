"""Which peers are near, by measured round trip: for relays (`swarm.net.relays`, `near`) and for placement
(`peer.placement` through `peer.balancer.Distances`, `region`).

For relays, a peer is near when its round trip is within `NEAR_FACTOR` times the nearest one's plus
`NEAR_SLACK_MS`.
Relative, because nobody configures a region: a few ms within a city, tens across a continent, a hundred and
more across an ocean; the slack keeps a handful of ms of jitter (or a busy peer's answer) from splitting a
machine room. With 2 ms one way within a region and 30 ms between two (the box's regions), the nearest is
about 5 ms, the cut 25 ms, the far ones 60 ms and more. Relays take the nearest public peers however far (a relay is
needed).

Placement's regions (`region`) use a fixed cut, `REGION_MS`: near is then mutual (round trips are the same
both ways), which placement needs: with the relative rule, A could count B near while B does not count A,
and peers each completing their own idea of a region moved in a cycle (found in simulation). A peer far from
everyone is a region of its own. Measured, not configured; between Frankfurt and Warsaw about 25 ms, across
the Atlantic about 80."""

from __future__ import annotations

from collections.abc import Mapping

NEAR_FACTOR, NEAR_SLACK_MS = 3.0, 10.0
REGION_MS = 50.0  # placement's regions: peers within this round trip of each other


def cut_ms(nearest_ms: float) -> float:
    """The largest round trip that counts as near, given the nearest one."""
    return NEAR_FACTOR * nearest_ms + NEAR_SLACK_MS


def near(rtt_ms: Mapping[str, float]) -> set[str]:
    """The keys of `rtt_ms` (round trips in ms) that are near; empty if there are none."""
    if not rtt_ms:
        return set()
    cut = cut_ms(min(rtt_ms.values()))
    return {key for key, ms in rtt_ms.items() if ms <= cut}


def region(rtt_ms: Mapping[str, float]) -> set[str]:
    """The keys of `rtt_ms` within `REGION_MS`: placement's region."""
    return {key for key, ms in rtt_ms.items() if ms <= REGION_MS}
