"""Repos for the test hub (`hub_server`): a tiny sharded checkpoint with a real (byte-level) tokenizer, and
any safetensors checkpoint (the demo model) split into shards."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import struct
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of a byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def write_byte_tokenizer(directory: str | Path, *, model_max_length: int = 256) -> Path:
    """Save a real tokenizer for the tiny checkpoints (vocab 256, pad/bos/eos 0/1/2): byte-level, where token
    id = byte value for bytes 3..255 and ids 0, 1, 2 are <pad>, <s>, </s>; with a chat template. Built
    offline with `tokenizers`; `AutoTokenizer.from_pretrained(directory)` loads it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(specials)} | {alphabet[b]: b for b in range(len(specials), 256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=model_max_length)
    fast.save_pretrained(directory)
    return Path(directory)


def build_sharded_repo(directory: str | Path, family: str = "llama", seed: int = 0,
                       max_shard_size: str | int | None = "200KB", **overrides) -> Path:
    """A tiny random checkpoint of `family` (see `tiny_models`) saved in shards of at most `max_shard_size`
    (a tiny llama in 200KB shards: 6 shards and an index), with generation_config.json and the byte
    tokenizer: everything a client loads from a hub."""
    from tiny_models import build_tiny_checkpoint

    directory = Path(directory)
    build_tiny_checkpoint(family, directory, seed, max_shard_size=max_shard_size, **overrides)
    write_byte_tokenizer(directory)
    return directory


def parse_size(size: str | int) -> int:
    """Bytes in "200KB", "60MB", "2GiB", ... (KB/MB/GB: powers of 1000, KiB/MiB/GiB: of 1024, as
    transformers' `max_shard_size`)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", size.strip().lower())
    if m is None:
        raise ValueError(f"not a size: {size!r}")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_kmgt".index(m.group(2) or "_"))


def _module_order(name: str) -> tuple:
    """Roughly the order of a model's modules, as `save_pretrained` writes them: embeddings, then each layer
    (all of its tensors together, layers by number), then the rest (final norm, LM head)."""
    m = re.search(r"\.(\d+)\.", name)
    group = int(m.group(1)) if m else (-1 if "embed" in name else float("inf"))
    return group, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def reshard(src_dir: str | Path, dest_dir: str | Path, max_shard_size: str | int) -> Path:
    """Copy a safetensors checkpoint into shards of at most `max_shard_size` (a tensor larger than that gets
    a shard of its own), as `save_pretrained(max_shard_size=...)` lays them out: tensors in module order, so a
    span of layers lies in few shards; `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`
    (or one `model.safetensors`). The tensors, names and dtypes are the source's; every other file (config,
    tokenizer, generation config) is copied as is, but for the demo model's marker. The demo model in "60MB"
    shards: 9 shards (the embeddings, then 4 to 5 layers each), in about 2 s. One shard's tensors are in memory
    at a time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from swarm.local.demo_model import MARKER_FILE

    src, dest = Path(src_dir), Path(dest_dir)
    if dest.exists() and any(dest.glob("*.safetensors")):
        raise FileExistsError(f"{dest} holds weights already")
    limit = parse_size(max_shard_size)
    index_path = src / "model.safetensors.index.json"
    if index_path.exists():
        sources = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        sources = ["model.safetensors"]
    tensors: list[tuple[str, str, int]] = []  # (name, source file, bytes)
    for name in sources:
        with open(src / name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        tensors += [(k, name, v["data_offsets"][1] - v["data_offsets"][0])
                    for k, v in header.items() if k != "__metadata__"]
    tensors.sort(key=lambda t: _module_order(t[0]))
    shards: list[list[tuple[str, str, int]]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x[2] for x in shards[-1]) + t[2] > limit:
            shards.append([])
        shards[-1].append(t)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    # Not the demo model's marker: it vouches for the converted checkpoint as built (one model.safetensors),
    # and `prepare_demo_model` would take a folder holding it for its own to rebuild.
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.name not in {*sources, index_path.name, MARKER_FILE}:
            shutil.copy2(p, dest / p.name)
    weight_map = {}
    with contextlib.ExitStack() as stack:
        opened = {name: stack.enter_context(safe_open(src / name, framework="pt")) for name in sources}
        for shard, out in zip(shards, names):
            save_file({t: opened[s].get_tensor(t) for t, s, _ in shard}, dest / out, metadata={"format": "pt"})
            weight_map.update({t: out for t, _, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t[2] for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
        (dest / index_path.name).write_text(json.dumps(index, indent=2) + "\n")
    return dest


