"""Local safetensors checkpoints: index, key mapping to the text decoder, shape checks, per-layer
memory-mapped reads (a 12B never resident at once), pickle refusal, and the tiny fixture builder."""

from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from harness import FIXTURES_DIR
from harness.atomic import atomic_directory, clean_stale_temps
from harness.errors import (CheckpointError, HarnessInputError, InputFileError, NumericsError, OutputError, os_problem,
                            not_a_file, read_json_file, read_problem, wrapped_os_error)
from harness.spec import LayerSpec, ModelSpec, load_spec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The unified multimodal checkpoint keeps the text decoder under model.language_model; a bare
# text checkpoint (Gemma4UnifiedForCausalLM) under model.
TEXT_PREFIXES = ("model.language_model.", "model.")
ROW_NORM_SPREAD = 0.5
POST_NORM_LOW, POST_NORM_SPAN = 2.0, 3.0
TINY_BUILDER_VERSION = 3
TINY_CONFIG = FIXTURES_DIR / "configs" / "gemma-4-tiny.json"
# Tiny transformers-built checkpoints of the family's variants (fixtures/configs/tiny/).
TINY_FAMILY = {name: FIXTURES_DIR / "configs" / "tiny" / f"gemma-4-tiny-{name}.json"
               for name in ("31b", "e2b", "e4b", "26b-a4b")}
TINY_CLASSES = {"gemma4_unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration"),
                "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
                "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM")}
SINGLE_FILE = "model.safetensors"  # what transformers loads first, when it exists
INDEX_FILE = "model.safetensors.index.json"  # otherwise this index and the shards it lists
# Weights the port and the reference cast to the run's dtype: integer or boolean tensors are not
# weights of this model, and casting them would make up numbers.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def expected_layer_shapes(spec: ModelSpec, layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """Names (relative to the layer) and shapes of one decoder layer's tensors."""
    h, d, i = spec.hidden_size, layer.head_dim, spec.mlp_size(layer)
    shapes = {
        "self_attn.q_proj.weight": (layer.q_heads * d, h),
        "self_attn.k_proj.weight": (layer.kv_heads * d, h),
        "self_attn.o_proj.weight": (h, layer.q_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
        "layer_scalar": (1,),
    }
    if not layer.k_eq_v:
        shapes["self_attn.v_proj.weight"] = (layer.kv_heads * d, h)
    if layer.kv_source is not None:  # a KV-shared layer reads another layer's cache: no k/v of its own
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight"):
            shapes.pop(name, None)
    shapes.update(family_layer_shapes(spec))
    return shapes


def family_layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The per-layer input's gate (E2B/E4B) and the MoE block (26B-A4B), as modeling_gemma4 names them."""
    h, p, shapes = spec.hidden_size, spec.per_layer_input_size, {}
    if p:
        shapes.update({"per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
                       "post_per_layer_input_norm.weight": (h,)})
    if spec.moe is not None:
        e, mi = spec.moe.num_experts, spec.moe.intermediate_size
        shapes.update({"router.proj.weight": (e, h), "router.scale": (h,), "router.per_expert_scale": (e,),
                       "experts.gate_up_proj": (e, 2 * mi, h), "experts.down_proj": (e, h, mi),
                       "post_feedforward_layernorm_1.weight": (h,), "post_feedforward_layernorm_2.weight": (h,),
                       "pre_feedforward_layernorm_2.weight": (h,)})
    return shapes


def model_level_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Decoder tensors outside the layers (names relative to the decoder prefix)."""
    h, p = spec.hidden_size, spec.per_layer_input_size
    shapes = {"embed_tokens.weight": (spec.vocab_size, h), "norm.weight": (h,)}
    if p:
        shapes.update({"embed_tokens_per_layer.weight": (spec.per_layer_vocab_size, spec.num_layers * p),
                       "per_layer_model_projection.weight": (spec.num_layers * p, h),
                       "per_layer_projection_norm.weight": (p,)})
    return shapes


# Model-level tensors the device holds (replicated on every rank); the per-layer table stays on the host.
DEVICE_MODEL_LEVEL = ("per_layer_model_projection.weight", "per_layer_projection_norm.weight")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Checkpoint:
    """A checkpoint directory opened for reading, validated against its own config.json.

    It reads exactly the files transformers' from_pretrained would load (model.safetensors when it
    exists, else the index and the shards it lists, or the config's `transformers_weights`), so the
    port and the reference always see the same tensors."""

    path: Path
    spec: ModelSpec
    prefix: str
    key_to_file: dict[str, Path]
    ignored_keys: list[str] = field(default_factory=list)
    ignored_files: list[str] = field(default_factory=list)
    _hashes: dict[str, str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path, validate: bool = True) -> "Checkpoint":
        path = Path(path)
        if not path.is_dir():
            what = "does not exist" if not path.exists() else "is not a directory"
            raise CheckpointError(f"{path}: {what}. Pass the checkpoint directory "
                                  "(the one save_pretrained wrote, with config.json and *.safetensors).")
        spec = load_spec(path)
        files, index_map, ignored_files = _weight_files(path)
        key_to_file = _key_map(path, files, index_map)
        prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in key_to_file), None)
        if prefix is None:
            raise CheckpointError(
                f"{path}: no text-decoder embedding key (looked for "
                f"{' or '.join(p + 'embed_tokens.weight' for p in TEXT_PREFIXES)}). This does not look "
                "like a Gemma-4 unified checkpoint; check the directory or re-save it with save_pretrained."
            )
        # Everything outside the text decoder (the unified class's vision/audio embedders) is inert.
        ignored = [k for k in key_to_file if not k.startswith(prefix) and k != "lm_head.weight"]
        ckpt = cls(path=path, spec=spec, prefix=prefix, key_to_file=key_to_file, ignored_keys=ignored,
                   ignored_files=ignored_files)
        if validate:
            ckpt.validate()
        return ckpt

    # -- names -------------------------------------------------------------------------------
    def layer_key(self, index: int, name: str) -> str:
        return f"{self.prefix}layers.{index}.{name}"

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        spec = self.spec
        shapes = {f"{self.prefix}{name}": shape for name, shape in model_level_shapes(spec).items()}
        for layer in spec.layers:
            for name, shape in expected_layer_shapes(spec, layer).items():
                shapes[self.layer_key(layer.index, name)] = shape
        if not spec.tie_word_embeddings:
            shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
        return shapes

    def validate(self) -> None:
        """Every tensor the spec needs is present, floating point, with the shape the config
        implies; no decoder tensor is left that the config does not account for."""
        expected = self.expected_shapes()
        for key, shape in expected.items():
            if key not in self.key_to_file:
                raise CheckpointError(
                    f"{self.path}: key {key} is missing (config.json implies it with shape {shape}). "
                    "The checkpoint is incomplete or was saved from a different config."
                )
        by_file: dict[Path, list[str]] = {}
        for key in expected:
            by_file.setdefault(self.key_to_file[key], []).append(key)
        for file, keys in by_file.items():
            with self._open(file) as f:
                for key in keys:
                    _check_stored(file, key, f.get_slice(key), expected[key])
        self._refuse_unexpected_decoder_keys(expected)

    def _refuse_unexpected_decoder_keys(self, expected) -> None:
        extra = sorted(k for k in self.key_to_file
                       if k.startswith(self.prefix) and k not in expected and k != "lm_head.weight")
        if extra:
            shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
            raise CheckpointError(
                f"{self.key_to_file[extra[0]]}: decoder tensor(s) {shown} are not used by the model "
                f"config.json describes ({self.spec.num_layers} layers; check num_hidden_layers, "
                "layer_types and attention_k_eq_v). transformers would drop them silently; use the "
                "config the weights were saved with.")

    def describe(self) -> str:
        lines = [f"checkpoint {self.path}: text decoder under '{self.prefix}', "
                 f"{len(set(self.key_to_file.values()))} safetensors file(s)",
                 self.spec.describe_inert()]
        if self.ignored_keys:
            lines.append(f"{len(self.ignored_keys)} multimodal embedder tensors outside the text decoder "
                         "ignored (vision/audio embedders; the checkpoint has no encoder towers)")
        if self.ignored_files:
            lines.append(f"not loaded (transformers does not load them either): {', '.join(self.ignored_files)}")
        return "\n".join(lines)

    # -- reads (memory-mapped, one tensor at a time) -------------------------------------------
    def _open(self, file: Path):
        return _safe_open(file)

    def get(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if key not in self.key_to_file:
            raise CheckpointError(f"{self.path}: key {key} is missing")
        with self._open(self.key_to_file[key]) as f:
            try:
                tensor = f.get_tensor(key)
            except Exception as exc:
                raise CheckpointError(f"{self.key_to_file[key]}: reading {key} failed ({exc}); "
                                      "the shard is truncated or corrupted.") from exc
        if not _all_finite(tensor):
            raise NumericsError(f"{self.key_to_file[key]}: {key} contains NaN or Inf; the weights "
                                "are corrupted (or were saved after a diverged run).")
        return tensor.to(dtype) if dtype is not None else tensor

    def layer_weights(self, index: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One decoder layer's tensors, names relative to the layer."""
        layer = self.spec.layers[index]
        return {name: self.get(self.layer_key(index, name), dtype)
                for name in expected_layer_shapes(self.spec, layer)}

    def embed_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.get(f"{self.prefix}embed_tokens.weight", dtype)

    def lm_head_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            return self.embed_weight(dtype)
        return self.get("lm_head.weight", dtype)

    def final_norm_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.get(f"{self.prefix}norm.weight", dtype)

    def per_layer_table(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The packed per-layer embedding table [per_layer_vocab, layers * per_layer_input] (host-side)."""
        if not self.spec.per_layer_input_size:
            return None
        return self.get(f"{self.prefix}embed_tokens_per_layer.weight", dtype)

    def device_model_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Model-level tensors outside the layers that the device holds (the PLE projection and norm)."""
        if not self.spec.per_layer_input_size:
            return {}
        return {name: self.get(f"{self.prefix}{name}", dtype) for name in DEVICE_MODEL_LEVEL}

    def check_finite(self) -> None:
        """Read every tensor the port uses once, one at a time: NaN or Inf is a NumericsError naming
        the key (transformers' own loader, which the reference uses, does not check)."""
        for key in self.expected_shapes():
            self.get(key)

    def check_inert_parts(self) -> None:
        """The tensors outside the text decoder have the shapes transformers' class gives them.
        The port never reads them, but the reference loads the whole model with from_pretrained,
        which refuses any mismatch (a zero-sized audio projection, say): refused here, before any
        model work, rather than by transformers after the port has run."""
        if not self.ignored_keys:
            return
        expected = _transformers_shapes(self.path)
        by_file: dict[Path, list[str]] = {}
        for key in self.ignored_keys:
            if key in expected:
                by_file.setdefault(self.key_to_file[key], []).append(key)
        for file, keys in by_file.items():
            with self._open(file) as f:
                for key in keys:
                    got = tuple(f.get_slice(key).get_shape())
                    if got != expected[key]:
                        raise CheckpointError(
                            f"{file}: {key} has shape {got} but transformers' model for config.json has "
                            f"{expected[key]}; the port ignores this inert tensor, but the reference cannot load "
                            "the checkpoint. Use the config the weights were saved with, or re-save them.")

    def weight_files(self) -> list[Path]:
        return sorted(set(self.key_to_file.values()))

    def file_hashes(self) -> dict[str, str]:
        """sha256 of config.json and every loaded safetensors file (computed once per opening: a
        12B's shards take a while to hash)."""
        if self._hashes is None:
            files = sorted(set(self.weight_files()) | {self.path / "config.json"})
            self._hashes = {p.name: sha256_file(p) for p in files}
        return dict(self._hashes)


def _transformers_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in transformers' class for the config, built on the meta device
    (no memory, no weights read)."""
    from transformers import AutoConfig, Gemma4UnifiedForCausalLM, Gemma4UnifiedForConditionalGeneration

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for configs it cannot read
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot read it ({exc})") from None
    cls = Gemma4UnifiedForConditionalGeneration if config.model_type == "gemma4_unified" else Gemma4UnifiedForCausalLM
    with torch.device("meta"):
        model = cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_stored(file: Path, key: str, view, shape: tuple[int, ...]) -> None:
    dtype = view.get_dtype()
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{file}: {key} is stored as {dtype}, not a floating-point type "
                              f"({', '.join(FLOAT_DTYPES)}). Casting it would make up weights; re-save "
                              "the checkpoint from the model in float32 or bfloat16.")
    got = tuple(view.get_shape())
    if got != shape:
        raise CheckpointError(
            f"{file}: {key} has shape {got} but config.json implies {shape}. "
            "The weights and config.json disagree; use the config the weights were saved with."
        )


def _all_finite(tensor: torch.Tensor) -> bool:
    """NaN/Inf check in the stored dtype with no temporary: the smallest and largest elements are
    finite exactly when every element is (torch.aminmax propagates NaN). One reduction pass:
    measured about 80x faster than isfinite() over blocks of a bf16 embedding, whose cost made the
    streaming reference about 2x slower than transformers' plain load at the 12B's width."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _safe_open(file: Path):
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


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, list[str]]:
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


def _key_map(path: Path, files: list[Path], weight_map: dict[str, str] | None) -> dict[str, Path]:
    """key -> file from the files' own headers; a key stored twice, or an index that disagrees
    with the shards, is refused (transformers would let one copy win silently)."""
    found: dict[str, Path] = {}
    for file in files:
        if not file.is_file():
            key = next((k for k, v in (weight_map or {}).items() if v == file.name), "?")
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} for key {key}: {not_a_file(file)}, not a "
                                  "safetensors file. Download the missing shard or re-save the checkpoint.")
        with _safe_open(file) as f:
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


# ---- the tiny fixture -----------------------------------------------------------------------

def cache_dir() -> Path:
    """$GEMMA_PARITY_CACHE (an empty value counts as unset), else ~/.cache/gemma-parity."""
    if os.environ.get("GEMMA_PARITY_CACHE", "").strip():
        return Path(os.environ["GEMMA_PARITY_CACHE"])
    try:
        return Path.home() / ".cache" / "gemma-parity"
    except RuntimeError:
        raise OutputError("no home directory to keep the tiny-model cache in; set GEMMA_PARITY_CACHE "
                          "to a writable directory") from None


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, config_path: str | Path = TINY_CONFIG,
                          logit_scale: float = 1.0, overwrite: bool = False) -> Path:
    """Write a random Gemma-4 checkpoint through transformers' own class and save_pretrained (the
    unified class for gemma4_unified configs, Gemma4ForConditionalGeneration for gemma4 ones).

    Deterministic from `seed`. Weights are sized so greedy logits have clear top-1 margins
    (embedding rows of unit scale; projections at 1/sqrt(fan_in)), and norm weights and
    layer_scalar are drawn away from 1.0 so that `1 + weight` or a dropped scalar shows.
    """
    import transformers

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists and is not empty; choose a new directory "
                              "(a checkpoint is never overwritten silently)")
    config = read_json_file(Path(config_path), "config", CheckpointError, "pass a Gemma-4 unified config.json")
    config.pop("architectures", None)
    config.pop("transformers_version", None)
    torch.manual_seed(seed)  # parts randomize_for_margins leaves alone (inert embedders) too
    config_cls, model_cls = TINY_CLASSES[config.get("model_type", "gemma4_unified")]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    randomize_for_margins(model, seed, logit_scale)
    _save_atomically(model, out_dir, overwrite)
    return out_dir


def randomize_for_margins(model, seed: int, logit_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if name.endswith("layer_scalar"):
                # |s - 1| >= 0.2 so that a missing layer_scalar is a visible error
                sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
                p.fill_(1.0 + sign * (0.2 + 0.3 * torch.rand((), generator=gen).item()))
            elif name.endswith("embed_tokens.weight"):
                # Row norms spread log-normally: a few rows dominate the tied lm_head, which widens
                # the top-1/top-2 gaps the way a trained model's peaked distributions do.
                rows = torch.exp(ROW_NORM_SPREAD * torch.randn(p.shape[0], 1, generator=gen))
                p.copy_(torch.randn(p.shape, generator=gen) * rows * logit_scale)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # With attention scaling 1.0, unit q/k norms give scores of std sqrt(head_dim): a
                # near-argmax softmax whose winner bf16 noise flips. Softer attention keeps the
                # random model well conditioned, and 0.3-0.6 is still far from 1.0.
                p.copy_(0.3 + 0.3 * torch.rand(p.shape, generator=gen))
            elif name.endswith(("language_model.norm.weight", "model.norm.weight")) and ".layers." not in name:
                # The final norm with random signs: with a tied lm_head the residual stream's copy
                # of the current token's embedding otherwise wins every step (a model that repeats
                # one token forever); signed weights cancel that self-logit, so greedy decode moves.
                signs = torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0)
                p.copy_(signs * (0.6 + 0.8 * torch.rand(p.shape, generator=gen)))
            elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                # Sublayer outputs comparable to the sqrt(hidden)-scaled embedding, so the residual
                # stream is not just the current token (which makes a model that copies its input).
                p.copy_(POST_NORM_LOW + POST_NORM_SPAN * torch.rand(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))
            elif name.endswith("embed_tokens_per_layer.weight"):
                # The packed per-layer table at a scale where its share of each layer's input shows.
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                # Away from 1.0, so that a dropped scale is a visible error.
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif p.dim() in (2, 3) and p.is_floating_point():  # 3: the stacked experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _save_atomically(model, out_dir: Path, overwrite: bool) -> None:
    """save_pretrained into a temp dir beside out_dir, then rename: nothing half written remains."""
    from harness.progress import third_party_bars

    third_party_bars()
    try:
        with atomic_directory(out_dir, replace=overwrite) as tmp:
            try:
                model.save_pretrained(tmp, safe_serialization=True)
            except Exception as exc:  # safetensors' own error type for a full disk
                if wrapped_os_error(exc) is None:
                    raise
                raise _cache_problem(wrapped_os_error(exc), out_dir) from None
    except HarnessInputError:
        # Another process (a pytest-xdist worker) finished the same deterministic build first.
        if not (out_dir / "config.json").is_file():
            raise


def tiny_checkpoint_path(seed: int = 0, config_path: Path = TINY_CONFIG) -> Path:
    """Where the cached tiny checkpoint for `seed` (and config) lives (built or not)."""
    # The builder's version is part of the key: a change in how weights are drawn must not reuse
    # a checkpoint cached by an older build.
    if not TINY_CONFIG.is_file():
        raise InputFileError(f"{TINY_CONFIG}: the tiny model's config is not installed ({not_a_file(TINY_CONFIG)}): "
                             "this gemma-parity was installed without its fixtures; reinstall it from the "
                             "repository (pip install .) or run it from a checkout")
    digest = hashlib.sha256(config_path.read_bytes() + f"builder-{TINY_BUILDER_VERSION}".encode()).hexdigest()[:10]
    stem = "tiny" if config_path == TINY_CONFIG else config_path.stem
    return cache_dir() / f"{stem}-{digest}-seed{seed}"


def _cache_problem(exc: OSError, where: Path) -> OutputError:
    return OutputError(os_problem(exc, where, "cannot use the tiny-model cache") +
                       "; or point GEMMA_PARITY_CACHE at a writable directory")


def tiny_checkpoint(seed: int = 0, config_path: Path = TINY_CONFIG) -> Path:
    """The cached tiny checkpoint for `seed` (12B-shaped unless another tiny config is given),
    built on first use.

    Safe under concurrent first use (pytest-xdist workers, parallel CI jobs): builders take an
    exclusive lock on a file beside the cache entry, and whoever comes second finds the entry
    complete and uses it. The entry appears by one rename, so `config.json` means complete."""
    path = tiny_checkpoint_path(seed, config_path)
    if (path / "config.json").is_file():
        return path
    cache = path.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f".lock-{path.name}", "a")
    except FileExistsError:
        raise OutputError(f"{cache}: the tiny-model cache is not a directory; point GEMMA_PARITY_CACHE "
                          "at a directory") from None
    except OSError as exc:
        raise _cache_problem(exc, cache) from None
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            clean_stale_temps(cache)
            if path.exists():
                raise CheckpointError(f"{path}: an incomplete tiny-model cache entry (no config.json); "
                                      "delete it and run again")
            build_tiny_checkpoint(path, seed=seed, config_path=config_path)
    return path
