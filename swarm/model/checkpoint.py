"""A local transformers checkpoint, read one part at a time.

Invariants:
- Only the tensors asked for are read from disk (safetensors slices are lazy until loaded), so a peer
  holds memory proportional to its span, never to the model.
- Models are described by a skeleton built on the `meta` device: it costs no memory and gives us the
  family's own module classes and the tensor names they expect. Weights are loaded into it with
  transformers' own conversion rules (e.g. per-expert MoE tensors on disk are fused on load), so a
  checkpoint loads here exactly as it would in `from_pretrained`.
- Nothing in transformers is subclassed or patched; layers are used as the family defines them.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (WeightConverter, WeightRenaming, convert_and_load_state_dict_in_model,
                                             rename_source_key)
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.modeling_utils import LoadStateDictConfig

from swarm.errors import CheckpointError, UnsupportedModel
from swarm.model import families
from swarm.model.streams import Boundary, Stream, streams_of
from swarm.span import Span

logger = logging.getLogger(__name__)

# Model types proven span by span against transformers (tests/models/test_every_family.py lists every
# type's outcome in docs/models.md). A type outside the table (a newer transformers) is attempted with
# a warning once it passes every check here.
VERIFIED_FAMILIES = families.EXACT
SEE = "see docs/models.md for every model type and why"
# Layer kinds whose cache is keys and values of every past token: the family's own forward builds
# their masks (causal, windowed, chunked) from the cache's length.
# An indexed kind also keeps its indexer's keys of every past token (dynamic sparse attention).
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
# Kinds whose cache is a recurrent state (state-space, linear attention, convolutions; hybrids hold both),
# kept per session with copies at step ends for rollback; and layers with no cache of their own.
RECURRENT_KINDS = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
# Kinds that keep keys and the states of compressors over windows of tokens (`swarm.model.compressed`).
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
LAYER_KINDS = ATTENTION_KINDS + RECURRENT_KINDS + COMPRESSED_KINDS + ("dummy",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelLayout:
    """Where a family keeps its parts and what its forward calls, read off a skeleton by a probe run."""

    layers_path: str  # attribute path of the decoder layer list in the causal-LM model, e.g. "model.layers"
    layer_types: tuple[str, ...]  # attention kind of every block, in ATTENTION_KINDS
    returns: str  # how the family's loop takes a layer's output: tensor, tuple (output[0]) or pair
    embed_dim: int  # width of the token embeddings (before any projection into the layers)
    head_modules: frozenset[str]  # modules the client's head calls: embedding, final norm, LM head, ...
    peer_modules: frozenset[str]  # modules a span's forward calls outside its layers (rotary, ...)
    streams: tuple[Stream, ...] = ()  # what the layers take per token besides the hidden states (`swarm.model.streams`)
    hidden_shape: tuple[int, ...] = ()  # per token, what the first layer takes: [hidden], or [streams, hidden]

    def block_prefix(self, block: int) -> str:
        return f"{self.layers_path}.{block}."


def read_config(path: str | Path) -> PretrainedConfig:
    """The config of checkpoint directory `path`, refused here if this project cannot serve its family (the
    cheap checks; `Checkpoint` runs the family's forward too)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a transformers checkpoint directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers cannot read this config.json: say which type and why
        raise _unreadable_config(path, exc) from exc
    check_supported(config)
    return config


def _unreadable_config(path: Path, exc: Exception) -> CheckpointError | UnsupportedModel:
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    reason = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    try:
        kind = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return CheckpointError(f"{path}/config.json is not a JSON object ({reason})")
    if not kind:
        return CheckpointError(f"{path}/config.json names no model_type ({reason})")
    if kind not in CONFIG_MAPPING_NAMES:
        return UnsupportedModel(f"model type {kind!r} is not known to transformers {__version__} ({SEE})")
    return CheckpointError(f"model type {kind!r}: transformers cannot read {path}/config.json ({reason})")


def num_blocks_of(config: PretrainedConfig) -> int:
    """The number of decoder layers (blocks) of the text decoder; refused where the config gives none."""
    try:
        text = config.get_text_config(decoder=True)
        return int(text.num_hidden_layers)
    except (AttributeError, TypeError, ValueError) as exc:  # no single stack of layers (or a malformed count)
        raise UnsupportedModel(f"model type {config.model_type!r}: its config gives no number of decoder layers "
                               f"({type(exc).__name__}: {str(exc).strip()[:200]}), so it has no list of decoder "
                               f"layers to split into blocks ({SEE})") from exc


class Checkpoint:
    """A checkpoint directory in the transformers format (config.json plus safetensors)."""

    def __init__(self, path: str | Path, config: PretrainedConfig | None = None, source=None):
        """`config`: the directory's config, if `read_config` already read it. `source`: where files not yet
        in `path` come from (a hub model, `swarm.weights.hub.HubModel`): a shard is fetched when a tensor
        of it is first read, and the shapes of shards not fetched come from their headers on the hub."""
        self.path = Path(path)
        self.source = source
        self.synthetic = False  # fill tensors of files not here with random values instead of fetching them
        self.config: PretrainedConfig = config if config is not None else read_config(self.path)
        self.model_type: str = self.config.model_type
        # Composite checkpoints (a language model with vision or audio towers) are served as their
        # language model: blocks, widths and layer kinds are the text model's.
        self.text_config: PretrainedConfig = self.config.get_text_config(decoder=True)
        self._keys: dict[str, str] | None = None
        self._key_rules: tuple | None = None  # read off the layout's skeleton before its probe (one build less)
        self.layout = self._read_layout()  # refuses what cannot be split, before any tensor is looked at
        self._files = self._index_tensors()

    @property
    def num_blocks(self) -> int:
        return num_blocks_of(self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def boundary(self) -> Boundary:
        """What a span takes and returns per token (the hidden states, then the family's other streams): its
        `width` is what the wire carries as hidden states."""
        shape = self.layout.hidden_shape or (self.hidden_size,)
        return Boundary(math.prod(shape), self.layout.streams, shape)

    def _index_tensors(self) -> dict[str, Path]:
        """Map every tensor name to the safetensors file that holds it (single file or sharded)."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return {name: self.path / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__})") from exc
        single = self.path / "model.safetensors"
        if not single.is_file() and self.source is not None:  # one file, not fetched yet: its header says
            return {name: single for name in self.source.load_shapes()[single.name]}
        if not single.is_file():
            raise CheckpointError(
                f"{self.path} has neither model.safetensors nor model.safetensors.index.json; "
                "only safetensors checkpoints are supported (convert .bin files with save_pretrained)"
            )
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}

    def skeleton(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The family's CausalLM built on the meta device: classes and names, no memory. The attention
        implementation is what transformers picks for the class (sdpa where it has it, else eager)."""
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config, dtype=dtype)

    def _read_layout(self) -> ModelLayout:
        """Find the layer list and run the family's forward around empty slots, before any weight loads:
        a family whose forward cannot be split at its layers is refused here, with the reason."""
        from swarm.model import frame as frames

        try:
            skel = self.skeleton()
        except Exception as exc:  # transformers cannot build the class from this config here
            raise UnsupportedModel(f"model type {self.model_type!r}: transformers cannot build its causal-LM class "
                                   f"from this config ({type(exc).__name__}: {str(exc).strip()[:200]})") from exc
        n = self.num_blocks
        path = find_layer_list(skel, n)
        if path is None:
            raise UnsupportedModel(f"model type {self.model_type!r}: no list of {n} decoder layers found in "
                                   f"{type(skel).__name__}, so it cannot be split into blocks")
        parallel = [name for name in parallel_layer_lists(skel, n) if name != path]
        if parallel:
            raise UnsupportedModel(f"model type {self.model_type!r} keeps per-layer weights outside its layer list "
                                   f"({', '.join(parallel[:3])}), so a block is not one module")
        try:
            tied = skel.get_expanded_tied_weights_keys(all_submodels=True)
        except Exception as exc:  # transformers cannot resolve the family's own tying rules on this config
            raise UnsupportedModel(f"model type {self.model_type!r}: transformers cannot resolve its tied weights "
                                   f"({type(exc).__name__}: {str(exc).strip()[:200]})") from exc
        into_layers = sorted((target, source) for target, source in tied.items()
                             if target.startswith(f"{path}.") or source.startswith(f"{path}."))
        if into_layers:
            target, source = into_layers[0]
            raise UnsupportedModel(f"model type {self.model_type!r} ties weights of its decoder layers to other "
                                   f"weights ({target} is {source}), so a block's weights are not its own")
        shadows = list(frames.get_path(skel, path))
        forward = inspect.signature(skel.forward).parameters
        if "cache" not in forward and "past_key_values" not in forward:
            raise UnsupportedModel(f"model type {self.model_type!r} keeps no cache of past tokens: every step would "
                                   "recompute the whole sequence on every peer")
        bidirectional = [name for name, m in shadows[0].named_modules()
                         if (getattr(m, "is_causal", None) is False or getattr(m, "is_decoder", None) is False)
                         and "cross" not in name and "encoder" not in name]
        if bidirectional:
            hint = " (its config sets is_decoder=false)" if getattr(self.text_config, "is_decoder", None) is False else ""
            raise UnsupportedModel(f"model type {self.model_type!r}: its attention is bidirectional{hint}, so a "
                                   "prefix cannot be computed before the tokens after it")
        shared_kv = int(getattr(self.text_config, "num_kv_shared_layers", 0) or 0)
        if shared_kv:
            raise UnsupportedModel(f"model type {self.model_type!r}: its last {shared_kv} layers attend with the keys "
                                   "and values earlier layers computed in the same forward (num_kv_shared_layers), "
                                   "which a span boundary cuts")
        embeddings = skel.get_input_embeddings()
        if not isinstance(embeddings, torch.nn.Embedding):
            raise UnsupportedModel(f"model type {self.model_type!r}: its input embeddings are "
                                   f"{type(embeddings).__name__}, not a token embedding table")
        streams = streams_of(self.text_config, shadows, embeddings.embedding_dim)
        try:
            self._key_rules = self._rules_of(skel)
        except Exception as exc:  # transformers' key mapping cannot be built for this class
            raise UnsupportedModel(f"model type {self.model_type!r}: transformers cannot map checkpoint names to "
                                   f"{type(skel).__name__} ({type(exc).__name__}: {str(exc).strip()[:200]})") from exc
        try:
            probe = frames.probe(skel, path, shadows, embeddings.embedding_dim,
                                 span_cache=lambda: self._session_cache(Span(0, n)).kv,
                                 extra=Boundary(self.hidden_size, streams).forward_kwargs(1, 2, torch.float32, "cpu"))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"model type {self.model_type!r}: {exc}") from exc
        except Exception as exc:  # any failure of the family's own code around empty slots
            raise UnsupportedModel(f"model type {self.model_type!r}: its forward cannot run around a span of "
                                   f"layers ({type(exc).__name__}: {str(exc)[:200]})") from exc
        return ModelLayout(layers_path=path, layer_types=layer_types(self.text_config),
                           returns=probe.returns, embed_dim=embeddings.embedding_dim,
                           head_modules=frozenset(probe.head_modules), peer_modules=frozenset(probe.peer_modules),
                           streams=streams, hidden_shape=probe.hidden_shape)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (its cache returns only to the ends of recent steps)."""
        kinds = get_layer_types_and_kwargs(self.text_config)[0]
        return any(kind in RECURRENT_KINDS + COMPRESSED_KINDS for kind in kinds)

    def _session_cache(self, span, batch: int = 1):
        from swarm.model.cache import SpanCache
        from swarm.model.family_cache import cache_class

        kinds, per_layer = get_layer_types_and_kwargs(self.text_config)
        return SpanCache(span, batch, 16, self.num_blocks, kinds, [kw.get("number_of_states", 1) for kw in per_layer],
                         layer_kwargs=per_layer, kv_class=cache_class(self.model_type))

    def model_key(self, name: str) -> str:
        """The model's name for checkpoint tensor `name`, by transformers' own key mapping (legacy
        names, fused experts, a composite model's prefixes)."""
        if self._keys is None:
            renamings, converters, prefix, meta = self._key_rules or self._rules_of(self.skeleton())
            try:
                self._keys = {k: rename_source_key(k, renamings, converters, prefix, meta)[0] for k in self._files}
            except Exception as exc:  # transformers' key mapping fails on this checkpoint's tensor names
                raise CheckpointError(f"model type {self.model_type!r}: transformers cannot map {self.path}'s tensor "
                                      f"names to the model ({type(exc).__name__}: {str(exc).strip()[:200]})") from exc
        return self._keys[name]

    @staticmethod
    def _rules_of(skel: torch.nn.Module) -> tuple:
        """What `model_key` needs of a skeleton not yet probed: transformers' renamings and converters for
        its classes, its base prefix, its (meta) state."""
        mapping = get_model_conversion_mapping(skel)
        return ([m for m in mapping if isinstance(m, WeightRenaming)], [m for m in mapping if isinstance(m, WeightConverter)],
                skel.base_model_prefix, skel.state_dict())

    def names_for(self, blocks=(), modules: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Checkpoint tensors of the given blocks and of the given (non-layer) modules' own tensors."""
        prefixes = tuple(self.layout.block_prefix(i) for i in blocks)
        out = []
        for name in self._files:
            key = self.model_key(name)
            if (prefixes and key.startswith(prefixes)) or key.rpartition(".")[0] in modules:
                out.append(name)
        return out

    def block_bytes(self, block: int, dtype: torch.dtype, quant: str = "none") -> int:
        """Bytes block `block`'s parameters take in `dtype`, from the file headers (nothing is loaded). With
        `quant`, the 2-D weights (the linear layers' inside a block) count at the quantized format's size."""
        from swarm.model.precision import weight_bytes_per_param

        shapes = [shape for _, shape in self._shapes(self.names_for([block])).values()]
        if quant == "none":
            return sum(math.prod(shape) for shape in shapes) * dtype.itemsize
        return int(sum(math.prod(shape) * (weight_bytes_per_param(quant, str(dtype).removeprefix("torch."))
                                           if len(shape) == 2 else dtype.itemsize) for shape in shapes))

    def _shapes(self, names: list[str]) -> dict[str, tuple[str, list[int]]]:
        """(safetensors dtype, shape) of the named tensors, from the headers of the files here, else from
        the source's (nothing is fetched)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        out, remote = {}, None
        for file, group in by_file.items():
            if not file.is_file() and self.source is not None:
                remote = remote or self.source.load_shapes()
                header = remote[self._rel(file)]
            else:
                header = _header(file)
            out.update({name: header[name] for name in group})
        return out

    def files_for(self, names: list[str]) -> set[str]:
        """Names of the files (shards) that hold the named tensors."""
        return {self._rel(self._files[name]) for name in names}

    def _rel(self, file: Path) -> str:
        return file.relative_to(self.path).as_posix()

    def stand_in(self) -> Checkpoint:
        """This checkpoint with random tensors for files not fetched yet: a block of the right shapes and
        format, to time before its weights arrive (never served)."""
        if self.source is None:
            return self
        twin = copy.copy(self)
        twin.synthetic = True
        return twin

    def missing_files(self, names: list[str]) -> list[str]:
        """Files holding the named tensors that are not here yet."""
        return sorted(f for f in self.files_for(names) if not (self.path / f).is_file())

    def fetch(self, names: list[str]) -> None:
        """Fetch the files holding the named tensors that are not here yet (from the source)."""
        missing = self.missing_files(names)
        if missing and self.source is not None:
            self.source.fetch(missing)

    @contextmanager
    def _slices(self, names: list[str]) -> Iterator[dict[str, object]]:
        """Lazy slices of the named tensors, each file opened once; nothing is read until sliced. Files of
        a source are fetched first; a synthetic checkpoint gives random tensors of the right shapes for
        files that are not here (to time a block before its weights arrive)."""
        if not self.synthetic:
            self.fetch(names)
        with ExitStack() as stack:
            handles: dict[Path, object] = {}
            slices: dict[str, object] = {}
            for name in names:
                file = self._files[name]
                if self.synthetic and not file.is_file():
                    dtype, shape = self._shapes([name])[name]
                    slices[name] = _random_tensor(dtype, shape)
                    continue
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                slices[name] = handles[file].get_slice(name)
            yield slices

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Attention cache bytes one token takes in the largest block (keys, values, an indexer's keys): blocks
        differ (Gemma 4's full and sliding layers), and a recurrent block keeps none per token."""
        def of(c) -> int:
            heads = getattr(c, "num_attention_heads", None) or 0
            head_dim = getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else 0)
            kv_heads = getattr(c, "num_key_value_heads", None) or heads
            return (2 * kv_heads * head_dim + (getattr(c, "index_head_dim", None) or 0)) * dtype.itemsize
        return max(of(c) for c in self.text_config.per_layer_config)

    def tensor_names(self, prefix: str) -> list[str]:
        return [n for n in self._files if n.startswith(prefix)]

    def load_into(self, model: torch.nn.Module, names: list[str], dtype: torch.dtype) -> None:
        """Read the named tensors (and only those) into `model`, applying the family's conversions."""
        if not names:
            raise CheckpointError(f"{self.path}: no tensors to load (is the checkpoint complete?)")
        with self._slices(names) as state:  # lazy: each tensor is read when loaded
            convert_and_load_state_dict_in_model(
                model,
                state,
                LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype),
            )


def _header(file: Path) -> dict[str, tuple[str, list[int]]]:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (is the checkpoint complete?)")
    with safe_open(file, framework="pt") as f:
        return {name: (None, list(f.get_slice(name).get_shape())) for name in f.keys()}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _random_tensor(dtype: str | None, shape: list[int]) -> torch.Tensor:
    kind = SAFETENSORS_DTYPES.get(dtype or "F32", torch.float32)
    if kind.is_floating_point:
        return torch.randn(shape, dtype=torch.float32).mul_(0.02).to(kind)
    return torch.zeros(shape, dtype=kind)


def check_supported(config: PretrainedConfig) -> None:
    """Refuse what cannot be split into decoder blocks, naming the model type and what works."""
    kind = config.model_type
    supported = SEE
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"model type {kind!r} is an encoder-decoder model; only decoder-only models "
                               f"can be served by a swarm ({supported})")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModel(f"model type {kind!r} is not a causal language model known to transformers "
                               f"({supported})")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"model type {kind!r} with bidirectional attention is not supported ({supported})")

    num_blocks_of(config)  # refused here where the config gives no layer count
    text = config.get_text_config(decoder=True)
    try:
        cache_kinds = get_layer_types_and_kwargs(text)[0]
    except Exception:  # noqa: BLE001 - a config transformers' cache cannot read: judged by layer_types alone
        cache_kinds = list(layer_types(text))
    unknown = sorted(set(cache_kinds) - set(LAYER_KINDS))
    if unknown:
        raise UnsupportedModel(f"model type {kind!r} uses layer kinds {unknown} that blocks cannot run yet; "
                               f"only {LAYER_KINDS} ({supported})")
    missing = _span_inputs_missing(text)
    if missing:
        raise UnsupportedModel(f"model type {kind!r}: {missing} ({supported})")
    if kind in families.INEXACT:
        raise UnsupportedModel(f"model type {kind!r} is not computed exactly in spans: {families.INEXACT[kind]} "
                               f"({supported})")
    if kind not in VERIFIED_FAMILIES:
        logger.warning("model type %r has not been checked against transformers (%s); trying it anyway", kind, SEE)


def _span_inputs_missing(text: PretrainedConfig) -> str:
    """What a span of this config's layers would need beyond the hidden states and streams a span takes and returns
    (`swarm.model.streams`): token ids ("" if nothing)."""
    reasons = []
    hashed = [i for i, kind in enumerate(getattr(text, "mlp_layer_types", None) or []) if kind == "hash_moe"]
    if hashed:
        reasons.append(f"its layers {hashed} pick their experts by token id (hash_moe), and a span is given hidden "
                       "states only, not the token ids (which the wire's 16-bit and 8-bit encodings would not keep)")
    ngrams = [i - 1 for i in getattr(text, "ple_layer_ids", None) or []]
    if ngrams:
        reasons.append(f"its layers {ngrams} embed n-grams of the token ids (ple_layer_ids), and a span is given "
                       "hidden states only, not the token ids")
    return "; ".join(reasons)


def parallel_layer_lists(model: torch.nn.Module, n: int) -> list[str]:
    """Lists of `n` modules with weights inside the text decoder (one of them is the layer list)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    root = decoder if isinstance(decoder, torch.nn.Module) else model
    prefix = next((name for name, m in model.named_modules() if m is root), "")
    return [f"{prefix}.{name}".strip(".") for name, m in root.named_modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) == n and any(True for _ in m.parameters())]


def find_layer_list(model: torch.nn.Module, n: int) -> str | None:
    """Attribute path of the decoder's list of `n` layers (inside the text decoder of a composite model)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    inside = {id(m) for m in decoder.modules()} if isinstance(decoder, torch.nn.Module) else None
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == n and n > 0]
    if inside is not None and any(id(m) in inside for _, m in found):
        found = [(name, m) for name, m in found if id(m) in inside]
    return min((name for name, _ in found), key=lambda name: name.count("."), default=None)


def layer_types(config: PretrainedConfig) -> tuple[str, ...]:
    """Attention kind of every block, as the family's own model forward decides it."""
    n = int(config.num_hidden_layers)
    declared = getattr(config, "layer_types", None)
    if declared:
        return tuple(declared[:n])
    # Families without `layer_types` (mistral, mixtral, phi3, ...) slide every layer when a window is set.
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return (kind,) * n
