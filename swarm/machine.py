"""Whether this machine's cores are all busy: what decides if a batch may wait for company at no cost.

A peer (and a gateway's head) computes a batch of whatever steps are ready; a larger batch costs far less per
token (the weights are read once per batch), but waiting for one idles the hardware while it waits. Unless every
core already has other work: then the time spent waiting is computed by someone else, and costs nothing. That is
the case when several processes of a swarm share one machine (a test box, a volunteer's desktop running its
peer beside other work), never when a peer has a machine to itself with cores to spare.

Linux reports the threads ready to run now in `/proc/loadavg` (the numerator of its fourth field, this thread
among them); elsewhere, and when it cannot be read, the cores are taken to be free: nothing ever waits.
"""

from __future__ import annotations

import os

LOADAVG = "/proc/loadavg"
CORES = os.cpu_count() or 1
# How long a batch (a peer's steps, a gateway's head rows) waits for the sessions of the last one at most, and
# only while every core is busy; and how often it looks again meanwhile
COMPANY_WAIT = 0.05
COMPANY_CHECK = 0.001


def cores_busy(path: str = LOADAVG) -> bool:
    """Whether more threads than this one are ready to run than the machine has cores."""
    try:
        with open(path) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return False
    return running - 1 >= CORES
