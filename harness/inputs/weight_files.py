"""Which files of a local checkpoint directory hold its weights, chosen the way transformers'
from_pretrained chooses them (model.safetensors, else the index and the shards it lists, or
config.json's transformers_weights), and which file holds each key; pickle weights are refused."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors import safe_open

from harness.base.errors import CheckpointError, HarnessInputError, InputFileError, not_a_file, read_json_file, read_problem

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SINGLE_FILE = "model.safetensors"  # what transformers loads first, when it exists
INDEX_FILE = "model.safetensors.index.json"  # otherwise this index and the shards it lists


def open_safetensors(file: Path):
    """safe_open, after a plain read of the file's first bytes so that permission problems are
    reported as such (and not as a corrupted file)."""
    try:
        with open(file, "rb") as f:
            f.read(8)
    except OSError as exc:
        raise InputFileError(read_problem(exc, file, "safetensors file")) from None
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:
        raise CheckpointError(f"{file}: cannot be read as safetensors ({exc}). The file is "
                              "truncated or corrupted; download or save it again.") from exc


def _list_dir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError as exc:
        raise InputFileError(read_problem(exc, path, "checkpoint directory")) from None


def weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, list[str]]:
    """(files to load, the index's weight_map or None, names present but not loaded), chosen the
    way transformers' from_pretrained chooses them for a local directory."""
    entries = _list_dir(path)
    names = [e.name for e in entries if e.name.endswith(".safetensors") or e.name == INDEX_FILE]
    explicit = _explicit_weights(path)
    for name in (SINGLE_FILE, INDEX_FILE):  # what transformers would pick, if it is there at all
        if explicit is None and os.path.lexists(path / name) and not (path / name).is_file():
            raise CheckpointError(f"{path / name}: {not_a_file(path / name)}, not a file; transformers would "
                                  "try to load it. Give the checkpoint's weights as regular files.")
    if explicit is not None:
        chosen = explicit
    elif (path / SINGLE_FILE).is_file():
        chosen = path / SINGLE_FILE
    elif (path / INDEX_FILE).is_file():
        chosen = path / INDEX_FILE
    else:
        _refuse_no_weights(path, entries)
    if chosen.name.endswith(".index.json"):
        weight_map = _read_index(chosen)
        files = [_inside(path, name, chosen) for name in sorted(set(weight_map.values()))]
        loaded = {f.name for f in files} | {chosen.name}
        return files, weight_map, [n for n in names if n not in loaded]
    return [chosen], None, [n for n in names if n != chosen.name]


def _explicit_weights(path: Path) -> Path | None:
    """config.json's `transformers_weights`, which from_pretrained loads instead of the defaults."""
    try:
        config = read_json_file(path / "config.json", "config", CheckpointError, "")
    except HarnessInputError:
        return None  # load_spec has already refused an unreadable config
    name = config.get("transformers_weights") if isinstance(config, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise CheckpointError(f"{path / 'config.json'}: transformers_weights={name!r} must name a "
                              "*.safetensors file or a *.safetensors.index.json inside the directory")
    file = _inside(path, name, path / "config.json")
    if not file.is_file():
        raise CheckpointError(f"{file}: named by config.json's transformers_weights but {not_a_file(file)}")
    return file


def _refuse_no_weights(path: Path, entries: list[Path]):
    shards = [e.name for e in entries if e.name.endswith(".safetensors")]
    if shards:
        raise CheckpointError(
            f"{path}: {', '.join(shards)} but no {SINGLE_FILE} and no {INDEX_FILE}. transformers loads "
            f"only {SINGLE_FILE} or the shards an index lists; rename a single file to {SINGLE_FILE}, or "
            "re-save the checkpoint with save_pretrained (which writes the index).")
    pickles = sorted(e.name for e in entries if e.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path}: only pickle weights found ({', '.join(pickles)}). Pickle checkpoints can "
            "run arbitrary code when loaded and are refused: convert to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True)) and point the tool there."
        )
    raise CheckpointError(f"{path}: no *.safetensors files. Pass a checkpoint directory "
                          "written by save_pretrained.")


def _inside(path: Path, name, source: Path) -> Path:
    """A file name from an index or config: a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{source}: file name {name!r} does not name a file inside {path}; "
                              "an index lists shard files of its own directory")
    return path / name


def _read_index(index_file: Path) -> dict[str, str]:
    index = read_json_file(index_file, "safetensors index", CheckpointError,
                           "not a valid safetensors index: download it again or re-save the checkpoint")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index_file}: not a valid safetensors index: it needs a non-empty "
                              '"weight_map" object of key -> shard file name; download it again')
    return weight_map


def key_map(path: Path, files: list[Path], weight_map: dict[str, str] | None) -> dict[str, Path]:
    """key -> file from the files' own headers; a key stored twice, or an index that disagrees
    with the shards, is refused (transformers would let one copy win silently)."""
    found: dict[str, Path] = {}
    for file in files:
        if not file.is_file():
            key = next((k for k, v in (weight_map or {}).items() if v == file.name), "?")
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} for key {key}: {not_a_file(file)}, not a "
                                  "safetensors file. Download the missing shard or re-save the checkpoint.")
        with open_safetensors(file) as f:
            for key in f.keys():
                if key in found:
                    raise CheckpointError(
                        f"{path}: key {key} is stored twice, in {found[key].name} and {file.name}; one copy "
                        "would silently win. Remove the duplicate shard or re-save the checkpoint.")
                found[key] = file
    for key, name in (weight_map or {}).items():
        if key not in found or found[key].name != name:
            where = f"it is in {found[key].name}" if key in found else "no shard holds it"
            raise CheckpointError(f"{path / INDEX_FILE}: lists key {key} in {name} but {where}; the "
                                  "index and the shards disagree: download them again or re-save")
    return found
