#!/bin/bash
# Build the wheels that benchmarks/gpu_single_device.sh installs on a GPU machine without network (this workplace's
# H200): cp312 manylinux wheels of what its image lacks, plus Ray stripped to fit the 64 MiB carry limit
# (benchmarks/RESULTS.md, "One-GPU recipes on an H200"). Run from the repo root; writes .whl/ (git-ignored).
#   PYTHON=venv/bin/python bash benchmarks/device_wheels.sh   the recipes' and tests' needs, trl (vs_trl.py),
#                                                              megatron-core and DeepSpeed
set -euo pipefail
OUT=${WHL:-.whl}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$OUT" "$@"
}
# What the device image lacks (its package list: ../.library/device/KINDS.md); the image has pyarrow, pandas,
# xxhash, aiohttp, rich, accelerate, hypothesis and nvidia-ml-py.
download pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 jsonschema==4.26.0 jsonschema-specifications \
  referencing rpds-py pebble pybase64==1.5.1 orjson==3.13.0 trl==1.16.0 megatron-core==0.19.2
# py-spy (the rollspy stage): a sampling profiler that reads the engine thread from outside the process
download py-spy==0.4.3
# DeepSpeed (the ds stage) is an sdist: built here into a pure-Python wheel (its ops are JIT, and unused), with the
# libraries it imports that the image lacks. Its build imports torch: PYTHON must have it (the project's venv).
download hjson py-cpuinfo ninja einops msgpack psutil
if ! ls "$OUT"/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w "$OUT" \
    || echo "no DeepSpeed wheel: $PY cannot build it (no torch?); the ds stage needs PYTHON=<the venv's python>" >&2
fi
# Ray: unzip, drop Java, RLlib and the LLM library, strip the binaries' symbol tables, then xz.
if ! ls "$OUT"/ray-*.tar.xz >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  download -d "$tmp" ray==2.60.0
  mkdir "$tmp/site"
  (cd "$tmp/site" && unzip -q ../ray-*.whl -x 'ray/jars/*' 'ray/rllib/*' 'ray/llm/*' \
    && strip --strip-unneeded ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet)
  tar cf - -C "$tmp/site" . | xz -6 -T2 > "$OUT"/ray-2.60.0.tar.xz
  rm -rf "$tmp"
fi
du -sh "$OUT"
