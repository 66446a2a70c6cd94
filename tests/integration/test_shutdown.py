"""A peer and a bootstrap stop promptly and quietly on SIGTERM: exit code 0 within `EXIT_S` seconds, no
traceback, no process left behind. Both when the signal reaches the process alone, and when it reaches its
whole process group (a terminal's Ctrl-C, a service manager): then the transport daemon, a child in the
same group, dies at the same moment, and nothing may wait for it to answer."""

from __future__ import annotations

import os
import signal
import time

import pytest

from swarm_harness import LocalSwarm, pid_alive, wait_until

pytestmark = pytest.mark.integration

EXIT_S = 3.0
# What a stop must not print: tracebacks, and the event loop's reports of tasks left behind (the first
# lines of "Task exception was never retrieved", "Task was destroyed but it is pending!" and the like).
NOISE = ("Traceback", "Task exception", "Task was destroyed", "Future exception")
# The CLI in a session (and process group) of its own, which its transport daemon and reaper join; a
# signal to that group reaches them all and nothing else.
OWN_GROUP = ("-c", "import os, sys; os.setsid(); from swarm.cli import main; sys.argv[0] = 'swarm'; "
                   "sys.exit(main(sys.argv[1:]))")


def stop_and_time(proc, to_group: bool) -> tuple[int, float]:
    """SIGTERM `proc` (or its process group); its exit code and the seconds it took to exit."""
    started = time.monotonic()
    if to_group:
        os.killpg(proc.popen.pid, signal.SIGTERM)  # the group `OWN_GROUP` made: its leader's pid
    else:
        proc.popen.send_signal(signal.SIGTERM)
    code = proc.popen.wait(30)
    return code, time.monotonic() - started


@pytest.mark.parametrize("to_group", [False, True], ids=["process", "group"])
def test_peer_and_bootstrap_exit_within_3_s_of_sigterm(tmp_path, tiny_llama, to_group):
    with LocalSwarm(tmp_path) as net:
        bootstrap = net.start_bootstrap("bootstrap", program=OWN_GROUP)
        # announcing every second, so a stop may come in the middle of an announcement
        peer = net.start_peer("peer", tiny_llama, "--blocks", "0:2", "--announce-interval", "1", program=OWN_GROUP)
        for proc in (peer, bootstrap):  # the peer first: the bootstrap then stops with no peer attached
            children = wait_until(lambda: proc.children() if len(proc.children()) >= 2 else None, 10,
                                  f"{proc.name}'s transport daemon and reaper")
            code, took = stop_and_time(proc, to_group)
            log = proc.text()
            assert code == 0, log[-3000:]
            assert took < EXIT_S, f"{proc.name} took {took:.1f} s to exit\n{log[-3000:]}"
            assert not [line for line in log.splitlines() if any(n in line for n in NOISE)], log[-3000:]
            wait_until(lambda: not any(pid_alive(p) for p in children), 5, f"{proc.name}'s children {children} to exit")
        assert "leaving: announcing blocks [0:2) offline" in peer.text()
