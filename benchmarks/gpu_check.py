"""The GPU check: weight formats on a CUDA GPU (float16, bfloat16, bitsandbytes int8 and nf4) and the demo
swarm with GPU peers, in the quality and speed table of `precision.py`.

Needs a machine with CUDA, torch built with CUDA and bitsandbytes (`pip install 'swarm-inference[gpu]'`).
CI never runs it (it is CPU-only); on a machine without CUDA it says so and exits 2.

    python benchmarks/gpu_check.py [--device cuda] [--head-device cpu] [--no-write]

Runs `precision.py --sections quality --device cuda --formats float32 float16 bfloat16 int8 nf4` and
writes the table into docs/benchmarks.md between the `precision-quality-gpu` markers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to measure", file=sys.stderr)
        return 2
    formats = ["float32", "float16", "bfloat16"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        formats += ["int8", "nf4"]
    else:
        print("gpu_check: bitsandbytes is not installed: int8 and nf4 are left out", file=sys.stderr)
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
    rest = [a for a in argv if a == "--no-write"]
    if "--head-device" in argv:  # the client's head elsewhere (the peers stay on `device`)
        rest += ["--head-device", argv[argv.index("--head-device") + 1]]
    import precision

    sys.argv = ["precision.py", "--sections", "quality", "--device", device, "--formats", *formats,
                "--section-suffix", "-gpu", *rest]
    return precision.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
