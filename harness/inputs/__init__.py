"""What the user hands in, checked before any model work: the config (spec), checkpoints, prompts; and the tiny fixture."""
