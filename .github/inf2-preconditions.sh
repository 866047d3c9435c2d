#!/usr/bin/env bash
# The first step of every job of .github/workflows/inf2.yml: what the job assumes of its runner and
# of the repository's settings, checked in seconds before anything is installed or compiled. One
# `::error::` line per missing thing, saying what to set; exit 1 when any is missing.
#
#   bash .github/inf2-preconditions.sh device   # the inf2 jobs (device, check-12b)
#   bash .github/inf2-preconditions.sh golden   # the large-memory CPU job (golden-12b)
#
# Assumed (docs/ci.md#the-device-workflow): the repository variable GEMMA_PARITY_12B_CHECKPOINT names a
# local directory on the runner holding the 12B's config.json and *.safetensors; on the inf2 runner
# the Neuron driver (/dev/neuron*), neuron-ls and the interpreter $PYTHON; on the golden runner, when
# the repository variable GEMMA_PARITY_GOLDEN_S3 is set, the AWS CLI with credentials from the
# instance's role (no AWS secret is stored in the repository). The workflow reads no repository
# secret: the only token is the job's own GITHUB_TOKEN.
set -uo pipefail
mode=${1:-}
missing=0
fail() { echo "::error::$1"; missing=1; }

case "$mode" in
  device | golden) ;;
  *) echo "::error::usage: $0 device|golden (got '${mode}')"; exit 2 ;;
esac

ckpt=${GEMMA_PARITY_12B_CHECKPOINT:-}
if [ -z "$ckpt" ]; then
  fail "GEMMA_PARITY_12B_CHECKPOINT is empty: set the repository variable (Settings -> Secrets and variables -> Actions -> Variables) to the 12B checkpoint's directory on this runner"
elif [ ! -f "$ckpt/config.json" ]; then
  fail "GEMMA_PARITY_12B_CHECKPOINT=$ckpt has no config.json on this runner: download google/gemma-4-12B-it there or fix the variable"
elif ! compgen -G "$ckpt/*.safetensors" >/dev/null; then
  fail "GEMMA_PARITY_12B_CHECKPOINT=$ckpt has no *.safetensors on this runner: the weights are missing"
fi

if [ "$mode" = device ]; then
  if ! compgen -G "${NEURON_DEVICE_GLOB:-/dev/neuron[0-9]*}" >/dev/null; then
    fail "no Neuron device (/dev/neuron*) on runner ${RUNNER_NAME:-?}: this job needs an inf2 instance with the Neuron driver (a Neuron DLAMI); check the runner's labels"
  fi
  command -v neuron-ls >/dev/null || fail "neuron-ls is not on PATH: install the Neuron tools (aws-neuronx-tools) on the runner"
  command -v "${PYTHON:-python3.12}" >/dev/null || fail "${PYTHON:-python3.12} not found: the Neuron SDK 2.31 wheels need Python 3.11-3.13"
fi

if [ "$mode" = golden ] && [ -n "${GOLDEN_S3:-}" ]; then
  case "$GOLDEN_S3" in
    s3://*) ;;
    *) fail "GEMMA_PARITY_GOLDEN_S3=$GOLDEN_S3 is not an s3://bucket/prefix URL" ;;
  esac
  if ! command -v aws >/dev/null; then
    fail "GEMMA_PARITY_GOLDEN_S3 is set but the AWS CLI is not on PATH: install it on the runner or clear the variable"
  elif ! aws sts get-caller-identity >/dev/null 2>&1; then
    fail "GEMMA_PARITY_GOLDEN_S3 is set but the AWS CLI has no credentials: give the runner's instance a role that can read and write that prefix"
  fi
fi

exit "$missing"
