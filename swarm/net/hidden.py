"""Hidden states as they travel: one encoding per tensor set, encoded and checked in one place.

float32/float16/bfloat16: the values cast to that dtype (one tensor). int8: blockwise 8-bit, two tensors:
int8 values [batch, tokens, hidden] and, per block of `int8_block(hidden)` values along the hidden
dimension, an int8 exponent e [batch, tokens, hidden / block]; a value is q * 2**e. The scale is the
power of two at or above the block's largest magnitude / 127, so decoding is exact arithmetic and
encoding what was decoded gives the same bytes again (`encode(decode(x)) == x`): a client that keeps
what it sent, decoded, replays exactly the bytes a peer was first given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.errors import BadRequest
from swarm.net.wire import Blob, blob_of, tensor_of, DTYPE_SIZES

FLOAT_ENCODINGS = ("float32", "float16", "bfloat16")
ENCODINGS = FLOAT_ENCODINGS + ("int8",)
INT8_BLOCK = 32  # values sharing one exponent (fewer when the hidden size is not a multiple of it)
MAX_EXPONENT = 121  # 127 * 2**121 < float32's largest: a decoded value is always finite


def int8_block(hidden: int) -> int:
    return next(b for b in (INT8_BLOCK, 16, 8, 4, 2, 1) if hidden % b == 0)


def encoding_bytes(encoding: str, hidden: int) -> float:
    """Bytes per hidden vector of `hidden` values in `encoding`."""
    if encoding == "int8":
        return hidden + hidden / int8_block(hidden)
    return hidden * DTYPE_SIZES[encoding]


def _check_encoding(encoding: Any) -> str:
    if encoding not in ENCODINGS:
        raise BadRequest(f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    return encoding


@dataclass(frozen=True)
class Hidden:
    """Hidden states [batch, tokens, hidden] in one encoding, as they travel."""

    encoding: str
    blobs: tuple[Blob, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.blobs[0].shape

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)

    @classmethod
    def encode(cls, tensor, encoding: str) -> Hidden:
        import torch

        _check_encoding(encoding)
        if tensor.ndim != 3:
            raise ValueError(f"hidden states travel as [batch, tokens, hidden], not {list(tensor.shape)}")
        if encoding in FLOAT_ENCODINGS:
            return cls(encoding, (blob_of(tensor.to(getattr(torch, encoding))),))
        x = tensor.detach().cpu().float()
        batch, tokens, hidden = x.shape
        block = int8_block(hidden)
        x = x.reshape(batch, tokens, hidden // block, block)
        mantissa, exponent = torch.frexp(x.abs().amax(-1) / 127)  # v = m * 2**e, m in [0.5, 1)
        exponent = (exponent - (mantissa == 0.5).int()).clamp(-128, MAX_EXPONENT)  # ceil(log2 v); v = 0: 2**0
        q = torch.round(torch.ldexp(x, -exponent[..., None].float())).clamp(-127, 127)
        return cls("int8", (blob_of(q.to(torch.int8).reshape(batch, tokens, hidden)),
                            blob_of(exponent.to(torch.int8))))

    def decode(self):
        """The values (float32 for int8): exactly what the sender's `round_trip` gave."""
        import torch

        if self.encoding in FLOAT_ENCODINGS:
            return tensor_of(self.blobs[0])
        q, exponent = tensor_of(self.blobs[0]), tensor_of(self.blobs[1])
        if exponent.numel() and int(exponent.max()) > MAX_EXPONENT:
            raise BadRequest(f"int8 exponents above {MAX_EXPONENT} would overflow")
        batch, tokens, hidden = q.shape
        blocks = exponent.shape[2]
        x = torch.ldexp(q.float().reshape(batch, tokens, blocks, hidden // blocks), exponent[..., None].float())
        return x.reshape(batch, tokens, hidden)

    @classmethod
    def take(cls, encoding: Any, blobs: tuple[Blob, ...]) -> tuple[Hidden, tuple[Blob, ...]]:
        """The hidden states at the front of a message's tensors, checked; and the tensors after them."""
        encoding = _check_encoding(encoding)
        count = 2 if encoding == "int8" else 1
        if len(blobs) < count:
            raise BadRequest(f"{encoding} hidden states need {count} tensors, got {len(blobs)}")
        own = blobs[:count]
        if len(own[0].shape) != 3:
            raise BadRequest(f"hidden states must be [batch, tokens, hidden], got {list(own[0].shape)}")
        if encoding in FLOAT_ENCODINGS:
            if own[0].dtype != encoding:
                raise BadRequest(f"hidden states said to be {encoding} are {own[0].dtype}")
        else:
            (values, exps), shape = own, own[0].shape
            if values.dtype != "int8" or exps.dtype != "int8" or len(exps.shape) != 3 \
                    or exps.shape[:2] != shape[:2] or exps.shape[2] != shape[2] // int8_block(shape[2]):
                raise BadRequest(f"int8 hidden states need int8 values {list(shape)} and int8 exponents "
                                 f"{list(shape[:2]) + [shape[2] // max(1, int8_block(shape[2]))]}, got "
                                 f"{values.dtype}{list(values.shape)} and {exps.dtype}{list(exps.shape)}")
        return cls(encoding, own), blobs[count:]


def round_trip(tensor, encoding: str):
    """What a receiver decodes of `tensor` sent in `encoding` (for a float encoding, the cast: no bytes made)."""
    import torch

    if encoding in FLOAT_ENCODINGS:
        return tensor.detach().to("cpu", getattr(torch, encoding))
    return Hidden.encode(tensor, encoding).decode()
