"""Errors for bad input: each names the file, key or value and says what to do (CLI exit 2)."""


class HarnessInputError(ValueError):
    """Bad input from the user: a config, checkpoint, golden, prompt or option the harness refuses."""


class ConfigError(HarnessInputError):
    """config.json is missing, of the wrong model_type, or asks for a feature the port lacks."""


class CheckpointError(HarnessInputError):
    """A checkpoint directory is missing shards or keys, has wrong shapes, or is a pickle."""


class GoldenError(HarnessInputError):
    """A golden is corrupted, incomplete, or was made for another spec."""


class PromptError(HarnessInputError):
    """A prompt is empty, has ids outside the vocabulary, or is longer than the largest bucket."""


class ShardingError(HarnessInputError):
    """A head layout cannot be split across the requested tensor parallel degree."""


class NumericsError(HarnessInputError):
    """NaN or Inf found in weights or activations."""
