"""HLO bundles: a failing graph as an HLO module with its inputs, expected outputs, compile command and toolchain; planted faults; the reducer."""
