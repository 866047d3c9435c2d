#!/bin/sh
# Compile, run and compare this bundle's HLO module (README.md). Usage: ./check.sh [cpu|neuron]
# (default: neuron where the Neuron SDK is installed, else cpu). Exit 0: outputs agree; 1: they do not
# (or the compiler failed); 2: the bundle cannot be judged here. Python: $PYTHON or python3.
HERE=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-python3}" "$HERE/run_hlo.py" "$HERE" "$@"
