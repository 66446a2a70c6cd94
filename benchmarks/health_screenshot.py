"""The screenshot of the swarm health page in docs/ (docs/health-page.png), from a live local swarm.

Starts a bootstrap serving the page and five peers of the demo model (real processes on 127.0.0.1):
three serve the model as `smollm2-135m-instruct` over [0:12), [10:22), [20:30); two serve it as a
second model, `smollm2-135m-staging`, over [0:15) and [15:30), and the second of those is then
killed, so the page shows an unreachable peer and blocks nobody serves. Once the monitor has seen
that, headless Chromium (Debian's `chromium`) takes the screenshot.

    python benchmarks/health_screenshot.py [--model DIR] [--out docs/health-page.png]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import browser  # noqa: E402
from swarm.local.demo_model import prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm, wait_until  # noqa: E402

MODELS = {"smollm2-135m-instruct": ("0:12", "10:22", "20:30"), "smollm2-135m-staging": ("0:15", "15:30")}
KILLED = "smollm2-135m-staging-1"


def snapshot(url: str) -> dict:
    with urllib.request.urlopen(url + "api/v1/swarm", timeout=10) as reply:
        return json.loads(reply.read())


def states(url: str) -> dict[str, list[str]]:
    return {m["model"]: sorted(p["state"] for p in m["peers"]) for m in snapshot(url)["models"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-model",
                        help="the demo checkpoint, prepared there if missing (default: .cache/demo-model, as in "
                        "the tests)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "health-page.png")
    args = parser.parse_args()
    path = prepare_demo_model(args.model)
    with tempfile.TemporaryDirectory(prefix="swarm-health-") as root, LocalSwarm(Path(root)) as net:
        net.start_bootstrap("bootstrap", "--monitor-port", "0", "--monitor-interval", "1")
        url = net.procs["bootstrap"].extra["monitor_url"]
        names = []
        for model, spans in MODELS.items():
            for i, blocks in enumerate(spans):
                names.append(f"{model}-{i}")
                net.start_peer(names[-1], path, "--model-id", model, "--blocks", blocks, "--cache-tokens", "4096",
                               wait=False)
        for name in names:
            net.wait_serving(net.procs[name], timeout=300)
        expected = {"smollm2-135m-instruct": ["online"] * 3, "smollm2-135m-staging": ["online"] * 2}
        wait_until(lambda: states(url) == expected, 60, "the monitor to see every peer online")
        net.stop(KILLED, signal.SIGKILL)
        expected["smollm2-135m-staging"] = ["online", "unreachable"]
        wait_until(lambda: states(url) == expected, 60, "the monitor to see the killed peer unreachable")
        time.sleep(3)  # a few refreshes, so record ages and latencies look like a running swarm
        args.out.parent.mkdir(parents=True, exist_ok=True)
        browser.screenshot(url, args.out, size=(1400, 540))
        print(f"wrote {args.out} from {url}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
