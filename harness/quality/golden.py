"""`gemma-parity quality`: the port's next-token distributions over a whole corpus, teacher-forced,
against a compact golden of the fp32 reference, side by side with the bf16 reference.

The corpus (token ids) is cut into windows of `window` tokens; each window is one teacher-forced
sequence from position 0, scored at every position but the last (predicting the next corpus
token). The reference pass streams the checkpoint one decoder layer at a time (as `reference
--stream` does), fp32 then bf16, for a part of `windows_per_part` windows at a time, and writes
each part's statistics (harness/quality/stats.py) to its own file, atomically: an interrupted pass
resumes at the first missing part and the golden comes out byte for byte the same. The windows can
be split into `n` contiguous shards, each written by its own run (`--shard i/n`, one CI job or
machine each) into its own subdirectory; the judged pass reads and merges every shard.

Golden layout: DIR/quality-golden.json (the settings every shard shares: corpus hash, window,
top-k, shards, spec and weights) and DIR/shard-III-of-NNN/part-JJJJJ.safetensors, with
DIR/shard-III-of-NNN/complete.json (each part's sha256) written when the shard is done.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

from harness.base.atomic import write_bytes_atomic, write_json_atomic
from harness.base.errors import GoldenError, HarnessInputError, InputFileError, read_problem
from harness.base.progress import status
from harness.quality.stats import DEFAULT_TOPK, bf16_columns, position_metrics, reference_stats

FORMAT = 1
SETTINGS_FILE = "quality-golden.json"
COMPLETE_FILE = "complete.json"
DEFAULT_WINDOW = 64
DEFAULT_WINDOWS_PER_PART = 16


@dataclass(frozen=True)
class GoldenSettings:
    corpus_sha256: str
    corpus_ids: int
    window: int
    topk: int
    shards: int
    windows_per_part: int
    spec_hash: str
    weights: dict

    @property
    def windows(self) -> int:
        return self.corpus_ids // self.window  # a trailing partial window is not scored

    def shard_windows(self, shard: int) -> range:
        return range(shard * self.windows // self.shards, (shard + 1) * self.windows // self.shards)

    def to_json(self) -> dict:
        return {"format": FORMAT, **self.__dict__, "positions": self.windows * (self.window - 1)}


def corpus_hash(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def read_corpus(path) -> list[int] | str:
    """The corpus file checked as far as no checkpoint is needed: a .json file's token ids (its shape,
    nesting and numbers: refused in milliseconds, before any model is opened), else its text."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputFileError(read_problem(exc, path, "corpus file")) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"--corpus {path}: not UTF-8 ({exc.reason} at byte {exc.start}); give UTF-8 text "
                             "or a JSON list of token ids") from None
    if not text.strip():
        raise InputFileError(f"--corpus {path}: is empty; give a JSON list of token ids or text to tokenize")
    return _json_ids(path, text) if path.suffix.lower() == ".json" else text


def load_corpus(path, checkpoint_dir, spec, read: list[int] | str | None = None) -> list[int]:
    """Token ids from a JSON file (a list of ids, or {"ids": [...]}) or text tokenized with the
    checkpoint's tokenizer; every id inside the vocabulary. `read`: read_corpus(path), when done."""
    path = Path(path)
    read = read_corpus(path) if read is None else read
    ids = read if isinstance(read, list) else _tokenize(path, read, checkpoint_dir)
    if not ids:
        raise InputFileError(f"--corpus {path}: holds no token ids; give a corpus of at least one --window of ids")
    bad = next((k for k, t in enumerate(ids) if not 0 <= t < spec.vocab_size), None)
    if bad is not None:
        raise InputFileError(f"--corpus {path}: token id {ids[bad]} at index {bad} is outside the vocabulary "
                             f"[0, {spec.vocab_size}) of {spec.source}; check the tokenizer the ids came from")
    return ids


def _json_ids(path: Path, text: str) -> list[int]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also a number of thousands of digits
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160]
        raise InputFileError(f"--corpus {path}: not a usable JSON list of token ids ({reason}); expected a flat "
                             "list of token ids (or {\"ids\": [...]})") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputFileError(f"--corpus {path}: expected a JSON list of integer token ids (or {{\"ids\": [...]}})")
    return ids


def _tokenize(path: Path, text: str, checkpoint_dir) -> list[int]:
    if not any((Path(checkpoint_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise InputFileError(f"--corpus {path}: a text corpus needs the checkpoint's tokenizer, and "
                             f"{checkpoint_dir} has none; give a .json file of token ids instead")
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(checkpoint_dir)(text, add_special_tokens=False)["input_ids"])


def golden_settings(checkpoint, ids: list[int], window: int, *, topk: int = DEFAULT_TOPK, shards: int = 1,
                    windows_per_part: int = DEFAULT_WINDOWS_PER_PART) -> GoldenSettings:
    if window < 2:
        raise HarnessInputError(f"--window {window}: need a window of at least 2 tokens")
    if len(ids) < window:
        raise HarnessInputError(f"--window {window}: longer than the whole corpus ({len(ids)} ids); use --window "
                                f"{len(ids)} or less (at least 2), or a longer corpus")
    settings = GoldenSettings(corpus_sha256=corpus_hash(ids), corpus_ids=len(ids), window=window, topk=topk,
                              shards=shards, windows_per_part=windows_per_part,
                              spec_hash=checkpoint.spec.spec_hash(), weights=checkpoint.file_hashes())
    if shards > settings.windows:
        raise HarnessInputError(f"--shard .../{shards}: more shards than windows ({settings.windows})")
    return settings


def _differing_settings(golden_dir: Path, settings: GoldenSettings) -> None:
    from harness.quality.parts import checked_settings, read_own_json

    file = golden_dir / SETTINGS_FILE
    found = checked_settings(read_own_json(file, f"remove {golden_dir} or choose another --golden"), file)
    differ = sorted(k for k, v in settings.to_json().items() if found.get(k) != v)
    if differ:
        raise GoldenError(f"--golden {golden_dir}: written for other settings ({', '.join(differ)} differ); "
                          "use a new --golden directory, or the same corpus, --window, --topk, shard count "
                          "and checkpoint as the run that started it")


def prepare_golden_dir(golden_dir, settings: GoldenSettings) -> None:
    """A new golden directory gets the settings; an existing one must have been written for the
    same corpus, window, top-k, shards and weights (it is resumed, never mixed or overwritten)."""
    golden_dir = Path(golden_dir)
    if (golden_dir / SETTINGS_FILE).exists():
        _differing_settings(golden_dir, settings)
        return
    if golden_dir.exists() and any(golden_dir.iterdir()):
        raise GoldenError(f"--golden {golden_dir}: exists and is not a quality golden (no {SETTINGS_FILE}); "
                          "choose a new or empty directory")
    write_json_atomic(golden_dir / SETTINGS_FILE, settings.to_json())


def verify_golden(golden_dir, settings: GoldenSettings, ids: list[int], vocab: int) -> None:
    """Before any model work: an existing golden's settings, and every part and seal it holds
    (harness/quality/parts.py); a damaged one is refused with the file to delete."""
    golden_dir = Path(golden_dir)
    if not (golden_dir / SETTINGS_FILE).exists():
        prepare_golden_dir(golden_dir, settings)  # refuses a foreign directory; writes nothing when it is not
        return
    _differing_settings(golden_dir, settings)
    for shard in range(settings.shards):
        for _ in verified_parts(golden_dir, settings, shard, ids, vocab):
            pass


def verified_parts(golden_dir, settings: GoldenSettings, shard: int, ids, vocab: int, sealed_only: bool = False):
    """(part range, file, tensors) of one shard's existing parts, each verified; a sealed shard's
    parts must also hash to its seal and the seal must name this golden's run."""
    from harness.quality.parts import check_identity, read_own_json, sha256_bytes, verify_part

    directory = shard_dir(golden_dir, shard, settings.shards)
    seal_file = directory / COMPLETE_FILE
    complete = None
    if seal_file.exists():
        complete = read_own_json(seal_file, f"delete {directory} and rerun its reference pass")
        check_identity(complete, settings.to_json(), seal_file, shard)
    elif sealed_only:
        raise GoldenError(f"--golden {golden_dir}: shard {shard} of {settings.shards} is not complete; run "
                          f"`gemma-parity quality --shard {shard}/{settings.shards}` for it")
    for j, part in enumerate(_parts(settings, shard)):
        file = directory / f"part-{j:05d}.safetensors"
        if not file.exists():
            if complete is not None:
                raise GoldenError(f"{file}: missing from a complete shard; delete {directory} and rerun its "
                                  "reference pass")
            continue
        if complete is not None and sha256_bytes(file.read_bytes()) != complete["parts"].get(file.name):
            raise GoldenError(f"{file}: not the file its shard recorded (sha256 differs); delete {directory} and "
                              "rerun its reference pass")
        corpus = None if ids is None else _windows(ids, settings, part)
        yield part, file, verify_part(file, part, settings, vocab, corpus)


def shard_dir(golden_dir, shard: int, shards: int) -> Path:
    return Path(golden_dir) / f"shard-{shard:03d}-of-{shards:03d}"


def _parts(settings: GoldenSettings, shard: int) -> list[range]:
    windows = settings.shard_windows(shard)
    step = settings.windows_per_part
    return [range(a, min(a + step, windows.stop)) for a in range(windows.start, windows.stop, step)]


def _windows(ids: list[int], settings: GoldenSettings, part: range) -> torch.Tensor:
    w = settings.window
    return torch.tensor([ids[i * w:(i + 1) * w] for i in part], dtype=torch.long)


def _part_tensors(checkpoint, windows: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """One part's golden: the fp32 reference's top-k statistics and the bf16 reference's metrics,
    both streamed one decoder layer at a time."""
    from harness.reference.stream import stream_prefill_captures_many

    # the part's windows as one batch: each layer is read once and runs them all in one call
    logits = {dtype: stream_prefill_captures_many(checkpoint, [windows], dtype, layer_captures=False)[0]
              ["capped_logits"][:, :-1] for dtype in (torch.float32, torch.bfloat16)}
    columns: dict[str, list] = {}
    for k, window in enumerate(windows):
        targets = window[1:]
        ref = reference_stats(logits[torch.float32][k], targets, topk)
        bf16 = position_metrics(ref, torch.log_softmax(logits[torch.bfloat16][k].double(), -1), targets)
        for name, t in {**ref, **bf16_columns(bf16)}.items():
            columns.setdefault(name, []).append(t)
    out = {name: torch.stack(ts).contiguous() for name, ts in columns.items()}
    out["tokens"] = windows.to(torch.int32).contiguous()
    return out


def write_shard(checkpoint, ids: list[int], golden_dir, settings: GoldenSettings, shard: int,
                progress: bool = False) -> Path:
    """The reference pass of one shard, resumed at its first missing part (the parts already there
    are verified first). Returns its directory."""
    out = shard_dir(golden_dir, shard, settings.shards)
    parts = _parts(settings, shard)
    say = status(f"quality reference {shard + 1}/{settings.shards}", progress, total=len(parts))
    vocab = checkpoint.spec.vocab_size
    done = {file.name for _, file, _ in verified_parts(golden_dir, settings, shard, ids, vocab)}
    hashes = {}
    for j, part in enumerate(parts):
        file = out / f"part-{j:05d}.safetensors"
        if file.name not in done:
            say(f"part {j + 1}/{len(parts)}: windows {part.start}-{part.stop - 1} (fp32 and bf16, streamed)")
            data = save(_part_tensors(checkpoint, _windows(ids, settings, part), settings.topk),
                        metadata={"windows": f"{part.start}-{part.stop}"})
            write_part(file, data)
        else:
            say(f"part {j + 1}/{len(parts)}: already written (verified, resumed)")
        hashes[file.name] = hashlib.sha256(file.read_bytes()).hexdigest()
    say.close()
    from harness.quality.parts import IDENTITY

    identity = {k: v for k, v in settings.to_json().items() if k in IDENTITY}
    write_json_atomic(out / COMPLETE_FILE, {"shard": shard, **identity, "parts": hashes,
                                            "windows": [parts[0].start, parts[-1].stop] if parts else [0, 0]})
    return out


def write_part(file: Path, data: bytes) -> None:
    """One part file, atomically (the resume point after an interruption)."""
    write_bytes_atomic(file, data)


def missing_shards(golden_dir, settings: GoldenSettings) -> list[int]:
    return [i for i in range(settings.shards) if not (shard_dir(golden_dir, i, settings.shards) / COMPLETE_FILE).is_file()]


def read_golden_parts(golden_dir, settings: GoldenSettings, vocab: int | None = None):
    """Every part of every shard in window order, each verified against its shard's seal and
    checked whole: yields (window range, tensors)."""
    vocab = vocab or (2 ** 31 - 1)  # the ids are int32
    for shard in range(settings.shards):
        for part, _, tensors in verified_parts(golden_dir, settings, shard, None, vocab, sealed_only=True):
            yield part, tensors


def golden_bytes(golden_dir) -> int:
    return sum(p.stat().st_size for p in Path(golden_dir).rglob("*") if p.is_file())
