"""How a session's hidden states travel: one encoding for decode steps, one for long prompt chunks.

Chosen once per session, when its first route is known (`choose_encodings`), from the route's peers'
formats and the client's options; every peer of the session (replacements included) is opened with
the same encodings. By default the wire is never less precise than the peers' own computation:
- float32 peers: float32 for everything (the output equals transformers' in float32);
- peers computing in 16 bits: their dtype (a cast they do anyway: lossless), and blockwise 8-bit for
  prompt chunks of `prefill_wire_tokens` tokens or more (a quarter of float32's bytes);
- quantized peers (int8/nf4 weights): bfloat16 (the range of float32; float16 could overflow) and 8-bit
  for long chunks.
A replay onto a replacement peer always travels in float32: the history holds the values the first
peers decoded (`swarm.net.hidden.round_trip`), of whatever encodings, and float32 carries each of them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLAY_ENCODING = "float32"


@dataclass(frozen=True)
class Encodings:
    decode: str = "float32"
    prefill: str = "float32"
    prefill_tokens: int = 64

    def for_tokens(self, tokens: int) -> str:
        return self.prefill if tokens >= self.prefill_tokens else self.decode

    @property
    def all(self) -> tuple[str, ...]:
        """What a peer is asked to accept: both, and the replay encoding."""
        return tuple(dict.fromkeys((self.decode, self.prefill, REPLAY_ENCODING)))


def choose_encodings(config, formats: Sequence[tuple[str, str]]) -> Encodings:
    """`formats`: (dtype, quant) of each peer of the route. `config`: a `ClientConfig` (wire, prefill_wire,
    prefill_wire_tokens)."""
    exact = all(dtype == "float32" and quant == "none" for dtype, quant in formats)
    if config.wire != "auto":
        decode = config.wire
    elif exact:
        decode = "float32"
    elif any(quant != "none" for _, quant in formats):
        decode = "bfloat16"
    else:  # the least precise peer's 16-bit dtype: float16 only if no peer computes in bfloat16
        decode = "float16" if {dtype for dtype, _ in formats} - {"float32"} == {"float16"} else "bfloat16"
    if config.prefill_wire != "auto":
        prefill = config.prefill_wire
    else:
        prefill = decode if exact else "int8"
    return Encodings(decode, prefill, config.prefill_wire_tokens)
