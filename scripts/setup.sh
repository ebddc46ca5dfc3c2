#!/usr/bin/env bash
# Installs every system package glm5 needs on a fresh Debian 12 machine (run as root or with sudo).
# CUDA, cuBLAS and NCCL are not installed here: they are detected at configure time when present.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-venv python3-pip \
  openmpi-bin libopenmpi-dev libucx-dev \
  libyaml-cpp-dev nlohmann-json3-dev libpcre2-dev libcli11-dev libboost-dev \
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev \
  iproute2 util-linux nftables \
  clang libclang-rt-dev libomp-dev llvm
