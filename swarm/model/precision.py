"""Where and in what precision a peer (or a client's head) computes: device, dtype and weight format.

One code path for every device: blocks are built on `Precision.device` in `Precision.dtype`, then the
decoder layers' linear weights are quantized if `Precision.quant` says so (`quantize`). What is
measured and why the defaults are what they are: docs/operations.md ("Devices and precision").

- device `auto`: a CUDA GPU if torch sees one, else Apple's MPS, else the CPU. Naming a device that is
  not there is a one-line `ConfigError`, never a traceback.
- dtype not chosen (None): float32, or `auto` with quantized weights (they compute in 16 bits); one chosen
  that the weight format cannot compute in is refused, naming the dtypes that work.
- dtype `auto`: bfloat16 on GPUs that compute it, float16 on older GPUs and MPS; on CPUs bfloat16 where
  the CPU computes it natively (avx512_bf16 or AMX), float32 elsewhere.
- quant `int8`: on CUDA, bitsandbytes' `Linear8bitLt` (LLM.int8()); on the CPU, `Int8Linear`: int8
  weights with a scale per output channel, computing in bfloat16 through torch's own int8-weight kernel
  (the fast path measured on these CPUs; each token's output depends on its own input only).
  `nf4`: bitsandbytes' 4-bit NormalFloat, CUDA only.

Exactness across formats: peers in different formats compute slightly different numbers for the same
input. A session keeps one format per span where it can (`client.inference.routing` prefers the format a span
was opened with on failover), and a client can refuse formats below a precision (`--min-precision`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.errors import ConfigError
from swarm.formats import DEVICE_HELP, DTYPES, QUANTS, format_name

if TYPE_CHECKING:
    import torch

def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda`, `cuda:N` or `mps` as a device that exists here, or a ConfigError."""
    import torch

    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name!r} is not a device: use {DEVICE_HELP}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, "
                              f"built {'with' if torch.version.cuda else 'without'} CUDA); use --device cpu or auto")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s), numbered 0-{count - 1}")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not _mps_available():
            raise ConfigError(f"--device {name}: Apple's MPS is not available here; use --device cpu or auto")
        return device
    raise ConfigError(f"--device {name!r} is not supported: use {DEVICE_HELP}")


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


@functools.cache
def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (avx512_bf16 or AMX), where bfloat16 runs fast."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype to compute in on `device`: the one named, or `auto`'s choice (see the module doc)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "mps":
        return "float16"
    return "bfloat16" if cpu_computes_bfloat16() else "float32"


def default_dtype(quant: str) -> str:
    """The dtype when none was chosen: float32 (exactly transformers' numbers), or, for quantized weights (which
    compute in 16 bits), `auto`'s 16-bit choice."""
    return "float32" if quant == "none" else "auto"


def check_quant(quant: str, device: torch.device, dtype: str) -> None:
    if quant not in QUANTS:
        raise ConfigError(f"--quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    if quant == "none":
        return
    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"--quant {quant} on CUDA needs bitsandbytes: pip install 'swarm-inference[gpu]'")
        if dtype == "float32":
            raise ConfigError(f"--quant {quant} on CUDA computes in 16 bits: use --dtype auto, bfloat16 or float16")
        return
    if quant == "nf4" or device.type != "cpu":
        raise ConfigError(f"--quant {quant} is not available on {device.type}: nf4 needs CUDA (bitsandbytes); "
                          "on the CPU use --quant int8")
    if dtype == "float32":
        raise ConfigError("--quant int8 on the CPU computes in 16 bits around its int8 weights (float32 there is "
                          "several times slower): use --dtype auto, bfloat16 or float16")


@dataclass(frozen=True)
class Precision:
    """Where and how blocks compute. Build with `Precision.of(device, dtype, quant)`."""

    device: torch.device
    dtype: str
    quant: str = "none"

    @classmethod
    def of(cls, device: str = "cpu", dtype: str | None = "float32", quant: str = "none") -> Precision:
        """`dtype` None: not chosen (`default_dtype`); a dtype chosen that `quant` cannot compute in is refused."""
        where = resolve_device(device)
        if dtype is None:
            dtype = default_dtype(quant)
        if dtype == "auto" and quant == "int8" and where.type == "cpu":
            dtype = "bfloat16"  # int8 weights computing in bfloat16: the CPU's int8 format
        chosen = resolve_dtype(dtype, where)
        check_quant(quant, where, chosen)
        return cls(where, chosen, quant)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def format(self) -> str:
        return format_name(self.dtype, self.quant)

    @property
    def device_kind(self) -> str:
        return self.device.type

    def describe(self) -> str:
        name = self.device_name()
        return f"{self.format} on {self.device}{f' ({name})' if name else ''}"

    def device_name(self) -> str:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return ""

    def memory(self) -> int | None:
        """Free memory of the device in bytes, when the device is not the host's memory."""
        import torch

        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free)
        return None


# ---- quantized weights ----

def quantize(module: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """Quantize the linear layers of `module` (one decoder layer) in place, as `precision.quant` says."""
    import torch

    if precision.quant == "none":
        return module
    if precision.device.type == "cuda":
        return _quantize_bitsandbytes(module, precision)
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, int8_linear_class().of(child, precision.torch_dtype))
        else:
            quantize(child, precision)
    return module


PACKED_ROWS = 48  # rows (tokens) below which torch's int8 weight kernel beats dequantizing to 16 bits


@functools.cache
def int8_linear_class():
    """`Int8Linear`, defined on first use (this module is imported without torch)."""
    import torch

    class Int8Linear(torch.nn.Module):
        """A linear layer with int8 weights (one scale per output channel) computing in 16 bits, on the CPU.

        Up to `PACKED_ROWS` rows (decode steps, small batches) go through torch's fused int8-weight matmul
        (`torch._weight_int8pack_mm`, its AVX-512 kernel for int8 weight-only linears); longer inputs
        (prefill chunks) multiply by the weights converted to 16 bits, then scale. Every output row depends
        on its own input row only: a token's output does not depend on the other tokens or sessions of the
        call, unlike dynamic int8 (activations quantized per call), so batching across sessions and exact
        replay stay what they are in float32. Weights: 1 byte per parameter plus 2 per output channel."""

        def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
            super().__init__()
            self.in_features, self.out_features = weight.shape[1], weight.shape[0]
            self.register_buffer("weight", weight)
            self.register_buffer("scales", scales)
            self.register_buffer("bias", bias)
            self.packed = _packed_kernel_works(weight, scales)

        @classmethod
        def of(cls, linear: torch.nn.Linear, dtype: torch.dtype):
            w = linear.weight.detach().float()
            scales = (w.abs().amax(1).clamp(min=1e-12) / 127).to(dtype)  # as stored: q is computed against it
            q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            bias = None if linear.bias is None else linear.bias.detach().to(dtype)
            return cls(q, scales, bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            x2 = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
            if self.packed and x2.shape[0] < PACKED_ROWS:
                y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
            else:
                y = torch.nn.functional.linear(x2, self.weight.to(x2.dtype)) * self.scales
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"

    return Int8Linear


def _packed_kernel_works(weight, scales) -> bool:
    """Whether torch's int8-weight kernel takes these weights, agreeing with the plain product."""
    import torch

    try:
        x = torch.ones(1, weight.shape[1], dtype=scales.dtype)
        fused = torch._weight_int8pack_mm(x, weight, scales)
        plain = torch.nn.functional.linear(x, weight.to(x.dtype)) * scales
        return bool(torch.allclose(fused.float(), plain.float(), rtol=2e-2, atol=1e-2 * float(plain.abs().max())))
    except (RuntimeError, AttributeError):  # an older torch, or a shape the kernel does not take
        return False


def _quantize_bitsandbytes(module: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    import torch

    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if not isinstance(child, torch.nn.Linear):
            _quantize_bitsandbytes(child, precision)
            continue
        weight = child.weight.data.to("cpu", torch.float16)
        bias = child.bias is not None
        if precision.quant == "int8":
            new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias, has_fp16_weights=False,
                                      threshold=6.0)
            new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias,
                                    compute_dtype=precision.torch_dtype, quant_type="nf4")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        if bias:
            new.bias = torch.nn.Parameter(child.bias.data.to("cpu", precision.torch_dtype), requires_grad=False)
        setattr(module, name, new.to(precision.device))  # moving to the GPU is what quantizes the weights
    return module


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes the weights of `module` take where they live, quantized weights included."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "meta":
            total += t.numel() * t.element_size()
            quant_state = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: absmax and its own state
            if quant_state is not None and getattr(quant_state, "absmax", None) is not None:
                total += quant_state.absmax.numel() * quant_state.absmax.element_size()
    return total


def weight_bytes_per_param(precision_quant: str, dtype: str) -> float:
    """Bytes per parameter of a decoder layer's linear weights in a format (scales included, roughly)."""
    import torch

    if precision_quant == "int8":
        return 1.0
    if precision_quant == "nf4":
        return 0.5 + 4 / 64
    return getattr(torch, dtype).itemsize
