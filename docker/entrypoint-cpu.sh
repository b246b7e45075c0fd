#!/bin/sh
# The CPU image's entrypoint. The preloaded OpenBLAS falls back to its slow "Prescott" kernels on
# CPUs it does not recognise (virtual machines often report a generic model): then name the
# kernels the CPU's flags allow, as the Makefile does. A preset OPENBLAS_CORETYPE is kept.
set -eu
if [ -z "${OPENBLAS_CORETYPE:-}" ] \
    && [ "$(OPENBLAS_VERBOSE=2 /bin/true 2>&1 | sed -n 's/^Core: //p')" = Prescott ]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo || true) "
    has() {
        for flag; do
            case "$flags" in *" $flag "*) ;; *) return 1 ;; esac
        done
    }
    if has avx512f avx512cd avx512bw avx512dq avx512vl; then
        export OPENBLAS_CORETYPE=SkylakeX
    elif has avx2 fma; then
        export OPENBLAS_CORETYPE=Haswell
    fi
fi
exec "$@"
