"""Facts and plumbing every layer may use: errors, numerics, atomic writes, progress, run settings, capture points."""
