"""Stops a transport daemon when its owner process dies, however it dies (SIGKILL included).

Run as `python -S reaper.py PID` with a pipe on stdin whose write end only the owner holds. When
the pipe reaches end of file the owner is gone: the daemon `PID` gets SIGTERM, then SIGKILL after a
grace period. A pidfd, taken at start, names exactly that process, so a reused PID is never hit.
This file imports nothing from the project: it must start fast and alone.
"""

import os
import select
import signal
import sys


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the terminal's group is the owner's to handle
    try:
        pidfd = os.pidfd_open(int(sys.argv[1]))
    except (IndexError, ValueError, OSError):
        return
    while sys.stdin.buffer.read(4096):
        pass
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return
        if select.select([pidfd], [], [], grace)[0]:  # readable once the process has exited
            return


if __name__ == "__main__":
    main()
