"""CPU int8 kernels against float32 and bfloat16: what `--quant int8` on the CPU is built on, and why.

8 pairs of random linear layers of a 2048-hidden, 5632-intermediate MLP (16 layers, 740 MB in float32),
run back to back at 1, 8 and 64 tokens per call, 2 threads; medians of `--runs`. Error: relative to
float32's output after all 16 layers. Batch effect: how far 4 rows run together are from each row run
alone (kernels differ in rounding by shape: tiny; dynamic int8 quantizes activations with one scale per
call, so a row's output moves with the other rows of the call).

- float32, bfloat16: `torch.nn.Linear`;
- dynamic int8: `torch.ao.quantization.quantize_dynamic` (fbgemm; deprecated by torch);
- int8 weights, bfloat16 compute: `swarm.model.precision.Int8Linear` (torch's `_weight_int8pack_mm` kernel
  below 48 rows, weights converted to bfloat16 above), what a CPU `--quant int8` peer runs;
- int8 weights, float32 compute: the same kernel with float32 activations (the slow path torchao's
  int8 weight-only config takes on a float32 model).

    python benchmarks/int8_kernels.py [--runs 15] [--no-write]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine, write_section  # noqa: E402

from swarm.model.precision import Precision, quantize  # noqa: E402

HIDDEN, INTERMEDIATE, PAIRS = 2048, 5632, 8


def stack() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(PAIRS):
        layers += [torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False), torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)]
    return torch.nn.Sequential(*layers).eval().requires_grad_(False)


def median_ms(f, x, runs: int) -> float:
    f(x)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def variants(base: torch.nn.Sequential) -> dict[str, tuple[torch.nn.Module, torch.dtype]]:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = quantize_dynamic(copy.deepcopy(base), {torch.nn.Linear}, dtype=torch.qint8)
    cpu = torch.device("cpu")
    return {
        "float32": (base, torch.float32),
        "bfloat16": (copy.deepcopy(base).to(torch.bfloat16), torch.bfloat16),
        "dynamic int8 (fbgemm)": (dynamic, torch.float32),
        "int8 weights, bfloat16 compute (ours)": (quantize(copy.deepcopy(base), Precision(cpu, "bfloat16", "int8")),
                                                  torch.bfloat16),
        "int8 weights, float32 compute": (quantize(copy.deepcopy(base), Precision(cpu, "float32", "int8")),
                                          torch.float32),
    }


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    base = stack()
    rows = []
    for name, (module, dtype) in variants(base).items():
        times = {}
        for tokens in (1, 8, 64):
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            times[tokens] = median_ms(lambda v: module(v.to(dtype)), x, args.runs if tokens < 64 else 5)
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
        ref = base(x)
        out = module(x.to(dtype)).float()
        alone = torch.cat([module(x[i:i + 1].to(dtype)).float() for i in range(4)])
        rows.append((name, times, float((out - ref).norm() / ref.norm()), float((out - alone).norm() / alone.norm())))
        print(f"{name}: {times}", file=sys.stderr, flush=True)
    f32 = rows[0][1]
    lines = ["### CPU int8 kernels", "", f"{machine()}; {PAIRS} pairs of random {HIDDEN}x{INTERMEDIATE} linear layers, 2 threads, medians.", "",
             "| weights | 1 token | 8 tokens | 64 tokens | 1 token vs float32 | error vs float32 | "
             "batch effect |", "|---|---|---|---|---|---|---|"]
    for name, times, error, batch in rows:
        lines.append(f"| {name} | {times[1]:.1f} ms | {times[8]:.1f} ms | {times[64]:.1f} ms | "
                     f"{f32[1] / times[1]:.1f}x | {100 * error:.1f}% | {batch:.0e} |")
    print("\n".join(lines))
    if not args.no_write:
        write_section("int8-kernels", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
