"""Names and ranks of the formats a peer computes in: dtypes, weight quantizations, precisions.

Torch-free, so clients, configs and records can name and compare formats without loading torch. What a
format does on a device (resolving `auto`, quantizing weights) is `swarm.model.precision`'s.
"""

from __future__ import annotations

DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = ("none", "int8", "nf4")
# precisions from the lowest; a format's rank is that of its weights
PRECISIONS = ("nf4", "int8", "16bit", "float32")


def precision_rank(dtype: str, quant: str) -> int:
    """Where a format stands among `PRECISIONS` (higher: closer to float32)."""
    if quant in ("int8", "nf4"):
        return PRECISIONS.index(quant)
    return PRECISIONS.index("float32" if dtype == "float32" else "16bit")


def format_name(dtype: str, quant: str) -> str:
    """A weight format as shown and compared: the dtype, or the quantization and the dtype around it."""
    return dtype if quant == "none" else f"{quant}/{dtype}"
