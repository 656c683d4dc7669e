#!/bin/sh
# Fill .whl/ (git-ignored) with what bench/gpu/validate.py needs on the device machine beyond its image:
# gpuwatch itself (built from this tree, so nothing is built there), the versions of grpcio and protobuf its generated stubs require,
# orjson, the nvidia-ml-py it is tested with, and HolisticTraceAnalysis with the two packages it imports
# (plotly, pydot; the rest of HTA's declared needs are notebook tooling it does not import).
# Run here, in the repository root, with the python that has pip: sh bench/gpu/wheels.sh
set -eu
PY=${PYTHON:-python3}
rm -rf .whl && mkdir .whl
"$PY" -m pip wheel -q --no-deps -w .whl .  # build isolation: needs setuptools >= 77 (PEP 639 license)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  grpcio==1.85.1 protobuf==7.36.2 orjson==3.13.0 nvidia-ml-py==13.615.71 \
  holistictraceanalysis==0.5.0 plotly==7.1.0 pydot==4.0.1 isal==1.9.1 google-crc32c==1.9.0
ls -l .whl
du -sh .whl
