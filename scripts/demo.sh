#!/usr/bin/env bash
# Set up (idempotent), build a tiny random-weight Llama, and run a real prefill/decode pair that
# moves KV through pdxfer: embedded master + prefill `vllm serve` + decode `vllm serve` + PD proxy,
# a few prompts through the proxy, outputs and transferred-token counts printed, then everything stops.
# Extra arguments go to `pdxfer launch` (e.g. --transport nixl, or drop --demo by running it yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdxfer launch --make-tiny-model .pdxfer-run/tiny-model --demo "$@"
