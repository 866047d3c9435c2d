"""`gemma-parity merge`: the quality golden's shards, written on several machines (each into its own
golden directory, `quality --shard I/N` or `--shard auto`), gathered into one golden directory.

Every source must carry the same quality-golden.json (corpus, window, top-k, shard count, spec,
weights); every shard 0..N-1 must be sealed in exactly one source (a missing or duplicated shard is
refused, naming it and where it was found); every part of every shard is verified (its seal's
hashes, its shapes, finiteness, ids: harness/quality/parts.py) before anything is written. The
merged golden is the bytes the one-process run writes (a part depends only on its windows), so
`quality --golden MERGED` then judges the port over the merged per-position rows: its quantiles are
those of one run, not a summary of summaries. The destination is written as a whole and must be
new or empty (a merge never replaces anything).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from harness.base.atomic import atomic_directory
from harness.base.errors import GoldenError, OutputError
from harness.quality.golden import SETTINGS_FILE, GoldenSettings, verified_parts, shard_dir
from harness.quality.parts import checked_settings, read_own_json

SHARD_DIR = re.compile(r"shard-(\d{3,})-of-(\d{3,})")


def _settings(source: Path) -> dict:
    file = source / SETTINGS_FILE
    if not file.exists():
        raise GoldenError(f"{source}: not a quality golden (no {SETTINGS_FILE}); give the --golden directories "
                          "the shard runs wrote")
    return checked_settings(read_own_json(file, f"rerun the shard that wrote {source}"), file)


def _settings_object(found: dict, source: Path) -> GoldenSettings:
    try:
        return GoldenSettings(**{k: found[k] for k in GoldenSettings.__dataclass_fields__})
    except (KeyError, TypeError) as exc:
        raise GoldenError(f"{source / SETTINGS_FILE}: incomplete ({exc}); rerun the shard that wrote it") from None


def _sealed_shards(source: Path, shards: int) -> list[int]:
    found = []
    for entry in sorted(source.iterdir()):
        match = SHARD_DIR.fullmatch(entry.name)
        if match and int(match.group(2)) == shards and (entry / "complete.json").exists():
            found.append(int(match.group(1)))
    return found


def plan_merge(sources: list[Path]) -> tuple[GoldenSettings, dict, dict[int, Path]]:
    """(settings, their JSON, shard -> source) after every refusal; reads, writes nothing."""
    first = _settings(sources[0])
    for source in sources[1:]:
        other = _settings(source)
        differ = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if differ:
            raise GoldenError(f"{source}: written for another run than {sources[0]} ({', '.join(differ)} differ); "
                              "merge only the shards of one corpus, window, top-k, shard count and checkpoint")
    settings = _settings_object(first, sources[0])
    owner: dict[int, Path] = {}
    for source in sources:
        for shard in _sealed_shards(source, settings.shards):
            if shard in owner:
                raise GoldenError(f"shard {shard} of {settings.shards} is in both {owner[shard]} and {source}; "
                                  "give each shard once")
            if shard >= settings.shards:
                raise GoldenError(f"{source}: holds shard {shard}, beyond the {settings.shards} shards")
            owner[shard] = source
    missing = [i for i in range(settings.shards) if i not in owner]
    if missing:
        raise GoldenError(f"shards {missing} of {settings.shards} are in none of the sources (or not sealed); run "
                          f"`gemma-parity quality --shard {missing[0]}/{settings.shards} ...` for each, then merge")
    for shard, source in owner.items():
        for _ in verified_parts(source, settings, shard, None, 2 ** 31 - 1, sealed_only=True):
            pass
    return settings, first, owner


def check_destination(dest: Path) -> None:
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise OutputError(f"--out {dest}: exists and is not an empty directory; a merge writes a new golden "
                          "and never replaces one: choose a new directory")


def write_merge(dest: Path, settings: GoldenSettings, owner: dict[int, Path]) -> Path:
    """Copy the settings and each shard's directory (seal and parts only) into `dest`, as a whole."""
    check_destination(dest)
    with atomic_directory(dest) as tmp:
        shutil.copyfile(owner[0] / SETTINGS_FILE, tmp / SETTINGS_FILE)
        for shard, source in sorted(owner.items()):
            src, out = shard_dir(source, shard, settings.shards), shard_dir(tmp, shard, settings.shards)
            out.mkdir()
            for file in sorted(src.iterdir()):
                if file.name == "complete.json" or re.fullmatch(r"part-\d{5}\.safetensors", file.name):
                    shutil.copyfile(file, out / file.name)
    return dest
