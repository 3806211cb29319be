#!/usr/bin/env bash
# `make demo`: for now, real answers from the embedded default model.
set -euo pipefail
.venv/bin/kvscope generate "What is the capital of France?" "Name three primary colors." \
  "Write a haiku about memory pages."
