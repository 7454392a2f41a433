"""Is a run checkpoint intact? Files present at the size they were written, the small ones (JSON state, RNG states,
tokenizer, all of a small model) with the SHA-256 they were written with, JSON parseable, safetensors headers readable
and covering their files. Cheap: no large tensor file is read; hashing a GLM-5-sized checkpoint's hundreds of GB
would take minutes on every save and resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST_KEY = "files"  # in orchestrator.json: {file name: size in bytes} of what the save wrote
CHECKSUM_KEY = "sha256"  # in orchestrator.json: {file name: SHA-256} of the files up to CHECKSUM_MAX_BYTES
CHECKSUM_MAX_BYTES = 64 * 1024**2


def manifest(directory: Path) -> dict[str, int]:
    """{relative path: size} of every file in a checkpoint directory being written, a role's subdirectory (critic/)
    included (recorded in orchestrator.json)."""
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def checksums(directory: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every file up to CHECKSUM_MAX_BYTES in a checkpoint directory being written."""
    return {p.relative_to(directory).as_posix(): _sha256(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.stat().st_size <= CHECKSUM_MAX_BYTES}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(directory: Path) -> str | None:
    """What is missing or corrupt in a checkpoint directory, in a few words; None when it is intact."""
    state_path = directory / "orchestrator.json"
    if not state_path.is_file():
        return "orchestrator.json is missing"
    try:
        state = json.loads(state_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"orchestrator.json is not valid JSON ({exc})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return "orchestrator.json has no integer 'step'"
    for name, size in (state.get(MANIFEST_KEY) or {}).items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {size} were written"
    if not (directory / "model.safetensors").is_file() and not (directory / "model.safetensors.index.json").is_file():
        return "model.safetensors is missing"
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        problem = _json_problem(path) if path.suffix == ".json" else safetensors_problem(path) if path.suffix == ".safetensors" else None
        if problem:
            return f"{path.relative_to(directory).as_posix()} {problem}"
    return _checksum_problem(directory, state.get(CHECKSUM_KEY) or {})


def _checksum_problem(directory: Path, sums: dict[str, str]) -> str | None:
    """The first file whose SHA-256 is not the one recorded when it was written, in a few words (checkpoints written
    before checksums were recorded have none)."""
    for name, digest in sums.items():
        if (directory / name).is_file() and _sha256(directory / name) != digest:
            return f"{name} does not hold what was written (its SHA-256 differs: changed or corrupted since)"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"is not valid JSON ({exc})"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a readable safetensors file (header, coverage of the data), or None."""
    from safetensors import safe_open  # noqa: PLC0415 - the check is the only user here

    try:
        with safe_open(str(path), "pt"):
            pass  # opening parses the header and checks that the data covers the file
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        return f"is not a readable safetensors file ({exc})"
    return None


def model_dir_problem(directory: Path) -> str | None:
    """What keeps `directory` from loading as an HF model directory, naming the file (one line); None when its
    config.json and safetensors files are readable. Tensor names and shapes are checked when the model loads."""
    config = directory / "config.json"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if not config.is_file():
        return f"{directory} has no config.json: not an HF-format model directory"
    if problem := _json_problem(config):
        return f"{config} {problem}"
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return f"{directory} holds no .safetensors weights"
    for path in files:
        if problem := safetensors_problem(path):
            return f"{path} {problem}"
    return None


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a model directory's weights (model.safetensors or its index's shards), headers only."""
    from safetensors import safe_open  # noqa: PLC0415

    index = directory / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    shapes = {}
    for name in files:
        with safe_open(str(directory / name), "pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def model_mismatch(checkpoint: Path, model_dir: Path) -> str | None:
    """The first tensor of `model_dir`'s model that `checkpoint` lacks or holds in another shape, in a few words; None
    when the checkpoint's weights fit that model. lm_head.weight may be absent from either (tied embeddings)."""
    saved, expected = weight_shapes(checkpoint), weight_shapes(model_dir)
    for name, shape in sorted(expected.items()):
        if name not in saved and name != "lm_head.weight":
            return f"model.safetensors has no tensor {name}"
        if name in saved and saved[name] != shape:
            return f"model.safetensors holds tensor {name} in shape {saved[name]}, this run's model in {shape}"
    return None
