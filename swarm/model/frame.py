"""The family's own model, run around a span of its layers: whatever it computes outside them is its own.

A swarm splits a model at its decoder layers. What a family computes before the first layer
(embedding scales and multipliers, norms on the embeddings, absolute position embeddings, alibi
slopes, masks, rotary tables) and after the last one (final norm, LM head, logit scales and
soft-caps) differs from family to family. Rather than re-implement any of it, every part of a
swarm runs the family's own causal-LM `forward` on an instance whose layer list holds our own
entries:

- a span's real layers, unchanged, where a peer serves them;
- a `LayerSlot` everywhere else: it holds no weights and passes its input through.

A call names where the span starts and ends. Hooks on the module API (never a patched or subclassed
transformers class) put the incoming hidden states in at the first layer of the span and stop the
forward with the output of its last one. The client's head uses the same frame with no layer at all:
it stops at slot 0 to read the embeddings the first layer would get, and puts hidden states in at
slot 0 to get the family's logits of them.

Invariants:
- Nothing the forward computes before the entry layer reaches it except what the family passes
  to layers (masks, position embeddings, alibi, ...): the entry's hidden states are replaced.
- Nothing after the exit layer runs on a peer.
- Calls are serialised per frame (a lock): the plan of a call lives on the frame while it runs.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch

from swarm.model.streams import arg_of, with_arg

ENTRY_KEYS = ("hidden_states", "hidden_state", "x", "hidden")


class _Leave(Exception):  # noqa: N818 - control flow, never escapes the frame
    def __init__(self, value):
        super().__init__()
        self.value = value


@dataclass
class Plan:
    """What one call does at the layer list: where hidden states go in and where the forward stops."""

    enter: object = None  # the module whose hidden-state input is replaced by `hidden`
    hidden: torch.Tensor | None = None
    leave: object = None  # the module after whose forward the call stops with its output
    capture: object = None  # a slot that stops the call with the hidden states it receives
    seen: list = field(default_factory=list)  # for probes: what slots received
    # A family's other per-token streams (`swarm.model.streams`): arguments given to real layers, by id of the
    # layer; arguments each slot reads off its call (`record`, into `recorded`); the leave layer's whole output.
    args: dict = field(default_factory=dict)
    record: tuple = ()
    recorded: list = field(default_factory=list)
    output: object = None


def hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    for key in ENTRY_KEYS:
        if key in kwargs:
            return kwargs[key]
    raise TypeError("cannot find the hidden states among a layer's arguments")


def with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    for key in ENTRY_KEYS:
        if key in kwargs:
            return args, {**kwargs, key: hidden}
    raise TypeError("cannot find the hidden states among a layer's arguments")


def unwrap(out) -> torch.Tensor:
    """A layer's hidden-state output, whether it returns a tensor or a tuple led by one."""
    return out if isinstance(out, torch.Tensor) else out[0]


class LayerSlot(torch.nn.Module):
    """A place in the family's layer list with no weights: passes its input through (in the form the
    family's loop expects) unless the running plan says to capture or replace it. Attributes the
    family's forward reads off its layers (attention type, index, ...) come from the layer's skeleton."""

    def __init__(self, index: int, shadow: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "_shadow", shadow)  # not registered: its (meta) weights are not ours
        self.slot_index = index
        self.returns = "tensor"  # the family loop's convention, set by the frame that holds the slot

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_shadow"), name)

    def forward(self, *args, **kwargs):
        plan = _CURRENT.plan
        hidden = hidden_of(args, kwargs)
        if plan is not None:
            plan.seen.append(hidden)
            if plan.record:
                shadow = object.__getattribute__(self, "_shadow")
                plan.recorded.append({name: arg_of(shadow, args, kwargs, name) for name in plan.record})
            if plan.capture is self:
                raise _Leave(hidden)
            if plan.enter is self:
                hidden = plan.hidden
            if plan.leave is self:
                raise _Leave(hidden)
        if self.returns == "tensor":
            return hidden
        return (hidden,) if self.returns == "tuple" else (hidden, None)


class Frame:
    """The family's causal-LM instance with its layer list replaced by `entries` (real layers or slots)."""

    def __init__(self, model: torch.nn.Module, layers_path: str, entries: list[torch.nn.Module],
                 returns: str = "tensor"):
        self.model = model
        self.layers_path = layers_path
        self._returns = returns
        self._lock = threading.Lock()
        parent, attr = _parent(model, layers_path)
        setattr(parent, attr, torch.nn.ModuleList(entries))
        self.entries = getattr(parent, attr)
        for entry in self.entries:
            if isinstance(entry, LayerSlot):
                entry.returns = returns
            else:
                hook_layer(entry)
        self.decoder = decoder_of(model, self.entries)
        self._params: dict[int, tuple[str, set]] = {}

    @property
    def returns(self) -> str:
        return self._returns

    @returns.setter
    def returns(self, value: str) -> None:
        self._returns = value
        for entry in self.entries:
            if isinstance(entry, LayerSlot):
                entry.returns = value

    def use(self, entries: torch.nn.ModuleList) -> None:
        """Put `entries` in as the family's layer list (one per block)."""
        parent, attr = _parent(self.model, self.layers_path)
        setattr(parent, attr, entries)

    def kwargs(self, runner: torch.nn.Module, **given) -> dict:
        """The given keyword arguments `runner`'s forward accepts (the cache under its own name)."""
        if id(runner) not in self._params:
            params = inspect.signature(runner.forward).parameters
            self._params[id(runner)] = ("cache" if "cache" in params else "past_key_values", set(params))
        cache_kw, takes = self._params[id(runner)]
        out = {}
        for key, value in given.items():
            if key == "cache":
                if value is not None:
                    out[cache_kw] = value
            elif key in takes and value is not None:
                out[key] = value
        return out

    def call(self, plan: Plan, entries: torch.nn.ModuleList | None = None, decoder: bool = False, **inputs):
        """Run the family's forward under `plan` (with `entries` as its layer list, if given): the value a
        `_Leave` carried, or the forward's output. `decoder`: run the text decoder's forward rather than the
        causal-LM's (what a span needs: no multimodal inputs, no head)."""
        runner = self.decoder if decoder else self.model
        with self._lock:
            if entries is not None:
                self.use(entries)
            _CURRENT.plan = plan
            try:
                return runner(**self.kwargs(runner, **inputs))
            except _Leave as done:
                return done.value
            finally:
                _CURRENT.plan = None


def decoder_of(model: torch.nn.Module, layers: torch.nn.Module) -> torch.nn.Module:
    """The text decoder that holds the layer list (what a span runs), else the whole model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(decoder, torch.nn.Module) and any(m is layers for m in decoder.modules()):
        return decoder
    return model


class _Current(threading.local):
    plan: Plan | None = None


_CURRENT = _Current()  # the running plan, for hooks on real layers (which may be shared by two frames)


def _enter_hook(module, args, kwargs):
    plan = _CURRENT.plan
    if plan is None or (plan.enter is not module and id(module) not in plan.args):
        return None
    if plan.enter is module:
        args, kwargs = with_hidden(args, kwargs, plan.hidden)
    for name, value in plan.args.get(id(module), {}).items():
        args, kwargs = with_arg(module, args, kwargs, name, value)
    return args, kwargs


def _leave_hook(module, args, kwargs, output):
    plan = _CURRENT.plan
    if plan is not None and plan.leave is module:
        plan.output = output
        raise _Leave(unwrap(output))
    return None


def hook_layer(layer: torch.nn.Module) -> None:
    """Let plans put hidden states into and stop after a real layer (once per layer object)."""
    if getattr(layer, "_swarm_hooked", False):
        return
    layer.register_forward_pre_hook(_enter_hook, with_kwargs=True)
    layer.register_forward_hook(_leave_hook, with_kwargs=True)
    layer._swarm_hooked = True


def _parent(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    *parents, attr = path.split(".")
    parent = model
    for name in parents:
        parent = getattr(parent, name)
    return parent, attr


def length_cache(batch: int, length: int, num_blocks: int, device=None, kv_class: type | None = None):
    """A cache that holds nothing but says it holds `length` tokens: what a family's embedding step reads
    positions from when its forward takes no position ids (of `kv_class`, where the family takes no other). Its entry
    is an indexed one: a family may keep its indexers' positions there (it reads and sets `indexer_position_ids`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicIndexedLayer

    layer = DynamicIndexedLayer()
    if length:
        layer.update(torch.zeros(batch, 1, length, 1, device=device), torch.zeros(batch, 1, length, 1, device=device))
    kv = (kv_class or DynamicCache)()
    kv.layers = [layer] * num_blocks
    return kv


def get_path(model: torch.nn.Module, path: str):
    parent, attr = _parent(model, path)
    return getattr(parent, attr)


@dataclass
class Probe:
    returns: str
    head_modules: set[str]
    peer_modules: set[str]
    hidden_shape: tuple[int, ...]  # per token, what the first layer takes (`swarm.model.streams.Boundary.shape`)


def probe(skeleton: torch.nn.Module, layers_path: str, shadows: list[torch.nn.Module], embed_dim: int,
          span_cache=None, extra: dict | None = None) -> Probe:
    """Run the family's forward on `skeleton` (emptied of its layers, its vocabulary tables constant, its
    other weights random) the three ways a swarm does: to the embeddings the first layer gets, from outside
    hidden states at a peer, and from hidden states to logits. Returns the loop's output convention, the shape of what
    the first layer takes per token, and which modules the head's and a peer's calls use (so only their tensors are
    loaded). `extra`: the forward's arguments for a
    family's other streams (`swarm.model.streams.Boundary.forward_kwargs`)."""
    extra = extra or {}
    slots = [LayerSlot(i, shadow) for i, shadow in enumerate(shadows)]
    frame = Frame(skeleton, layers_path, slots)
    skeleton.to_empty(device="cpu")
    # The vocabulary-sized tables are most of what is left (56M of 57M parameters on the demo model), and
    # drawing them at random took 0.5 s of every checkpoint's opening. Their values never matter here:
    # a constant, and transformers' own flag that leaves them out of `initialize_weights`.
    for table in (skeleton.get_input_embeddings(), skeleton.get_output_embeddings()):
        weight = getattr(table, "weight", None)
        if isinstance(weight, torch.Tensor) and not getattr(weight, "_is_hf_initialized", False):
            with torch.no_grad():
                weight.fill_(0.02)
            weight._is_hf_initialized = True
    skeleton.initialize_weights()
    skeleton.eval()
    names = {id(m): name for name, m in skeleton.named_modules()}
    inside = f"{layers_path}."
    ids = torch.tensor([[3, 4]])
    position_ids = torch.arange(2).unsqueeze(0)

    def called(run) -> set[str]:
        seen: set[str] = set()

        def record(module, args):
            name = names.get(id(module))
            if name is not None and name != layers_path and not name.startswith(inside):
                seen.add(name)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
        try:
            with torch.inference_mode():
                run()
        finally:
            handle.remove()
        return seen

    first = []
    embed = called(lambda: first.append(frame.call(Plan(capture=slots[0]), input_ids=ids, position_ids=position_ids,
                                                   use_cache=False)))
    if not isinstance(first[0], torch.Tensor) or first[0].ndim < 3 or tuple(first[0].shape[:2]) != (1, 2):
        from swarm.errors import UnsupportedModel

        shape = list(first[0].shape) if isinstance(first[0], torch.Tensor) else type(first[0]).__name__
        raise UnsupportedModel(f"its layers take hidden states of shape {shape} for 1 sequence of 2 tokens, not "
                               "[batch, tokens, ...], so they cannot be cut into tokens for the wire")
    shape = tuple(first[0].shape[2:])  # per token: [hidden], or several residual streams [streams, hidden]
    # A span's call, with the cache a session would have: a family that wants a cache of its own is found here.
    peer = called(lambda: frame.call(Plan(capture=slots[0]), decoder=True, inputs_embeds=torch.zeros(1, 2, embed_dim),
                                     position_ids=position_ids, cache=span_cache() if span_cache else None,
                                     use_cache=span_cache is not None, **extra))
    # The loop's convention for a layer's output: a tensor, a 1-tuple, or (hidden states, attention
    # weights). The first under which the next slot gets hidden states of the right shape is the family's.
    for convention in ("tensor", "tuple", "pair"):
        frame.returns = convention
        plan = Plan(enter=slots[0], hidden=torch.zeros(1, 2, *shape),
                    capture=slots[1] if len(slots) > 1 else None)
        try:
            frame.call(plan, inputs_embeds=torch.zeros(1, 2, embed_dim), position_ids=position_ids, use_cache=False,
                       **extra)
        except Exception:  # noqa: BLE001 - not this convention
            if convention == "pair":
                raise
            continue
        if len(slots) == 1 or (isinstance(plan.seen[1], torch.Tensor) and plan.seen[1].shape == (1, 2, *shape)):
            break
    tail_plan = Plan(enter=slots[0], hidden=torch.zeros(1, 2, *shape))
    out = {}
    tail = called(lambda: out.update(logits=_logits(frame.call(tail_plan, inputs_embeds=torch.zeros(1, 2, embed_dim),
                                                                position_ids=position_ids, use_cache=False,
                                                                **extra))))
    if out["logits"] is None or out["logits"].shape[:2] != (1, 2):
        raise TypeError(f"the forward gave no logits for 2 positions (got {out['logits']!r:.80})")
    if len(tail_plan.seen) != len(slots):
        from swarm.errors import UnsupportedModel

        raise UnsupportedModel(f"its forward runs {len(tail_plan.seen)} layer calls for {len(slots)} layers (layers "
                               "looped or skipped), so a span's output is not what the next span takes")
    return Probe(returns=frame.returns, head_modules=embed | tail, peer_modules=peer, hidden_shape=shape)


def _logits(output):
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def build(ckpt, dtype: torch.dtype, device: torch.device, blocks=(), modules=frozenset(),
          shared: dict | None = None, tie: bool = False) -> tuple[Frame, dict[int, torch.nn.Module]]:
    """The family's model with blocks `blocks` (read from disk unless in `shared`) and the named non-layer
    `modules` loaded; every other layer is a slot and every other weight stays on the meta device.
    Returns the frame and its real layers by block index."""
    from swarm.errors import CheckpointError, UnsupportedModel

    shared = shared or {}
    layout = ckpt.layout
    skel = ckpt.skeleton(dtype)
    fresh = [i for i in blocks if i not in shared]
    names = ckpt.names_for(fresh, modules)
    if names:
        ckpt.load_into(skel, names, dtype)
    layer_list = get_path(skel, layout.layers_path)
    layers = {i: shared.get(i, layer_list[i]) for i in blocks}
    entries = [layers[i] if i in layers else LayerSlot(i, layer_list[i]) for i in range(len(layer_list))]

    tied = set(getattr(skel, "all_tied_weights_keys", None) or {}) if tie else set()
    owned = [(name, skel.get_submodule(name)) for name in sorted(modules)]
    owned += [(f"{layout.layers_path}.{i}", layers[i]) for i in fresh]
    missing = []
    for name, module in owned:
        for pname, param in module.named_parameters(recurse=name.startswith(f"{layout.layers_path}.")):
            if param.device.type == "meta" and f"{name}.{pname}" not in tied:
                missing.append(f"{name}.{pname}")
    if missing:
        where = sorted({int(m[len(layout.layers_path) + 1:].split(".")[0]) for m in missing
                        if m.startswith(f"{layout.layers_path}.")})
        blocks_note = f"block {', '.join(map(str, where))} " if where else ""
        raise CheckpointError(f"{ckpt.path}: {blocks_note}missing tensors {missing[:4]} (checkpoint incomplete?)")
    for name, module in owned:
        for sub in module.modules() if name.startswith(f"{layout.layers_path}.") else [module]:
            for bname, buf in list(sub._buffers.items()):
                if buf is not None and buf.device.type == "meta":
                    sub._buffers[bname] = torch.empty_like(buf, device="cpu")
    frame = Frame(skel, layout.layers_path, entries, layout.returns)
    with torch.no_grad():
        skel.initialize_weights()  # computed buffers (rotary tables, embedding scales), as from_pretrained does
        if tie:
            try:
                skel.tie_weights()
            except Exception as exc:  # the family's tying rules cannot be applied to a frame of its layers
                raise UnsupportedModel(f"model type {ckpt.model_type!r}: its tied weights cannot be tied around a span "
                                       f"of its layers ({type(exc).__name__}: {str(exc).strip()[:200]})") from exc
    for name, module in owned:
        if name.startswith(f"{layout.layers_path}."):
            module.to(device)
        else:  # only the module's own tensors: its children may be other parts, left on meta
            module._apply(lambda t: t.to(device), recurse=False)
    skel.requires_grad_(False)
    skel.eval()
    return frame, layers


def position_ids_for(batch: int, new_tokens: int, position: int, mask: torch.Tensor | None,
                     device: torch.device) -> torch.Tensor:
    """Positions of `new_tokens` tokens placed at `position`; with a 0/1 mask, as transformers' generate
    counts them for left-padded batches (only real tokens count)."""
    if mask is None:
        return torch.arange(position, position + new_tokens, device=device).unsqueeze(0).expand(batch, -1)
    ids = mask.long().cumsum(-1) - 1
    ids = ids.masked_fill(mask == 0, 1)
    return ids[:, position:position + new_tokens].to(device)
