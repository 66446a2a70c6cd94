"""A light client (`--transport libp2p`) in a process of its own, for the tests: it must never share a process
with hivemind. Generates greedy tokens through the swarm and prints one JSON line.

    python tests/light_runner.py MODEL_DIR MODEL_ID IDS MAX_NEW_TOKENS [--pause-after K] ADDR...

IDS: comma-separated prompt token ids. With `--pause-after K`, after K new tokens it prints
`paused <peer id of each hop>` and waits for a line on stdin before going on (a test faults a peer meanwhile).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    pause_after = None
    if "--pause-after" in args:
        i = args.index("--pause-after")
        pause_after, args = int(args[i + 1]), args[:i] + args[i + 2:]
    path, model_id, ids, tokens, addrs = args[0], args[1], args[2], int(args[3]), args[4:]
    import torch

    from client.model import DistributedModelForCausalLM

    prompt = torch.tensor([[int(t) for t in ids.split(",")]])

    class Pause:
        seen = 0

        def put(self, value) -> None:
            self.seen += 1
            if pause_after is not None and self.seen == pause_after + 1:  # the first put is the prompt
                route = model.active_session.route
                print("paused " + " ".join(f"{h.span.start}:{h.span.end}={h.peer}" for h in route), flush=True)
                sys.stdin.readline()

        def end(self) -> None:
            pass

    started = time.perf_counter()
    with DistributedModelForCausalLM.from_pretrained(path, addrs, model_id=model_id, transport="libp2p",
                                                     verify_fraction=0) as model:
        joined = time.perf_counter() - started
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False,
                             pad_token_id=0, streamer=Pause())
        refused = model.connection.node.refused
    import gc
    import logging

    print(json.dumps({"tokens": out[0].tolist(), "hivemind": "hivemind" in sys.modules, "joined_s": joined,
                      "refused": refused, "libp2p_package": hasattr(sys.modules.get("libp2p"), "new_host"),
                      "basic_host": "libp2p.host.basic_host" in sys.modules, "frozen": gc.get_freeze_count(),
                      "libp2p_log_level": logging.getLogger("libp2p").getEffectiveLevel(),
                      "not_loaded": [m for m in ("aioquic", "httpx", "cryptography.x509", "libp2p.security.tls")
                                     if m not in sys.modules]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
