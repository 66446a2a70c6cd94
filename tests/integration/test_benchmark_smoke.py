"""The benchmark harness end to end: `benchmarks/swarm_bench.py --smoke` (tiny model, two peers, both
modes, delay proxies at 0 and 10 ms) writes its tables with numbers, the swarm's tokens match local
transformers', the added delay shows in every hop, and no process it started is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?x?$")


def in_session(sid: int) -> list[int]:
    """PIDs of live processes in session `sid` (the harness runs in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def section(text: str, name: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"no section {name} in:\n{text}"
    return text[text.index(begin):text.index(end)]


def rows(text: str) -> dict[str, list[str]]:
    """Table rows by their first cell (header and separator rows left out)."""
    out, last = {}, None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(c and set(c) <= set("-") for c in cells):
            out.pop(last)  # the row before a separator is the header
            continue
        out[cells[0]], last = cells[1:], cells[0]
    return out


def test_swarm_bench_smoke(tmp_path):
    out = tmp_path / "bench.md"
    bench = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "swarm_bench.py"), "--smoke", "--out",
                              str(out), "--root", str(tmp_path / "swarm")], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = bench.communicate(timeout=180)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    deadline = time.monotonic() + 15
    while in_session(bench.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = in_session(bench.pid)
    for pid in left:  # ours: started in the harness's own session
        os.kill(pid, signal.SIGKILL)
    assert bench.returncode == 0, output[-5000:]
    assert not left, f"processes left by the harness: {left}"
    assert "left running: none" in output

    text = out.read_text()
    loop = section(text, "swarm_bench_loopback_tiny")
    assert "The swarm's tokens equal local transformers' in every run." in loop
    table = rows(loop)
    for row in ("swarm, chained", "swarm, relayed"):
        assert all(NUMBER.match(c) for c in table[row][:6]), table[row]
        assert table[row][6] == "0", f"{row}: failovers on an idle loopback swarm"
    assert all(NUMBER.match(c) for c in table["transformers, local"][:3])
    assert all(NUMBER.match(table[p][i]) for p in ("peer0", "peer1") for i in (1, 2, 3)), table

    wan = section(text, "swarm_bench_wan_tiny")
    assert "The swarm's tokens equal local transformers' in every run." in wan
    table = rows(wan)
    assert set(table) == {"0", "10"}, table
    for cells in table.values():
        assert all(NUMBER.match(c) for c in cells), cells
    relayed_hop = float(table["10"][5])  # columns: info, ms/token x2, ratio, per-hop overhead x2, ttft x2
    assert relayed_hop >= 9.5, f"a relayed hop through a 10 ms proxy took {relayed_hop} ms more than compute"
    assert float(table["10"][0]) >= 9.5, "an info call through a 10 ms proxy was faster than 10 ms"
    assert "client–peer pairs through a proxy 4 of 4, peer–peer pairs through a proxy 1 of 1, direct " \
           "connections between them 0" in wan
