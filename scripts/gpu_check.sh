#!/usr/bin/env bash
# The GPU checks, in one prepared run on one GPU (about 5 minutes):
#
#   0. what is there: nvidia-smi, Python/torch/CuPy/NCCL/mpi4py versions, which mpiexec
#   1. tests/gpu, 1 rank, NCCL
#   2. tests/gpu, 2 ranks on the one GPU, NCCL (NCCL_MULTI_RANK_GPU_ENABLE=1; needs NCCL >= 2.30)
#   3. tests/gpu, 2 ranks, COLLECTIVES_DISABLE_NCCL=1 (host staging)
#   4. benchmarks/bench_nccl.py: ours / raw NCCL, 1 rank and (if step 2 could run) 2 ranks
#   (tests/gpu includes test_torch_backend_cuda.py: DDP with CUDA tensors over the torch.distributed backend
#    "collectives", equal to one process, and dist.* collectives on CUDA, in steps 1-3; and test_p2p_cuda.py:
#    coll.send/recv and dist.send/recv/batch_isend_irecv of CUDA arrays, ncclSend/ncclRecv in steps 1-2,
#    host staging in step 3; and test_cuda.py's reproducible sums of CUDA arrays, which must give the bits of
#    host arrays on NCCL and on host staging (a tree's CUDA leaves too, packed into buckets on the device),
#    and DistributedOptimizer(reproducible=True) on a GPU model)
#   5. benchmarks/bench_training.py --device cuda: the training step with the gradient buckets (overlap,
#      views, sharded state) on CUDA tensors, 1 rank and (if step 2 could run) 2 ranks over NCCL
#
# Usage: bash scripts/gpu_check.sh          (from anywhere; output also goes to $OUT if set)
# The tests run with COLLECTIVES_TEST_REQUIRE_GPU=1: no GPU is a failure, not a skip.
# Without mpiexec: wheels/ (if present) is installed offline (pip --no-index); else only the 1-rank
# steps run, with plain python, and the log says so. Exit status 0 only if every step that ran passed.
# $OUT receives at most 5 files (gpu_check.log, bench_nccl_n1.json, bench_nccl_n2.json,
# bench_training_cuda_n1.json, bench_training_cuda_n2.json).

set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
OUTDIR=${OUT:-$ROOT/.gpu-check}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
export COLLECTIVES_TEST_REQUIRE_GPU=1
export PYTHONUNBUFFERED=1
RESULTS=()
FAILED=0

section() { printf '\n==== %s ====\n' "$*"; }
record() {  # name rc
    if [ "$2" -eq 0 ]; then RESULTS+=("ok    $1"); else RESULTS+=("FAIL  $1 (exit $2)"); FAILED=1; fi
}
skip() { RESULTS+=("skip  $1: $2"); echo "SKIPPED: $1: $2"; }

section "machine"
date -u
nvidia-smi || echo "nvidia-smi: not available"
section "versions"
"$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("numpy", "torch", "cupy", "mpi4py", "pytest"):
    try:
        m = importlib.import_module(name)
        extra = ""
        if name == "torch":
            extra = f" cuda={m.version.cuda} available={m.cuda.is_available()} devices={m.cuda.device_count()}"
        if name == "cupy":
            try:
                extra = f" runtime={m.cuda.runtime.runtimeGetVersion()} devices={m.cuda.runtime.getDeviceCount()}"
            except Exception as e:
                extra = f" ({type(e).__name__}: {e})"
        if name == "mpi4py":
            from mpi4py import MPI
            extra = " " + MPI.Get_library_version().splitlines()[0]
        print(f"{name} {getattr(m, '__version__', '?')}{extra}")
    except Exception as e:
        print(f"{name}: not usable ({type(e).__name__}: {e})")
try:
    from collectives._backends import _libnccl
    print("nccl", _libnccl.info())
except Exception as e:
    print(f"collectives: not importable ({type(e).__name__}: {e})")
EOF

find_mpiexec() {
    local here
    here=$(dirname "$PY")/mpiexec
    if [ -x "$here" ]; then echo "$here"; else command -v mpiexec || true; fi
}
MPIEXEC=$(find_mpiexec)
echo "which mpiexec: ${MPIEXEC:-<none>}"
NEED=()
"$PY" -c "import pytest" 2>/dev/null || NEED+=(pytest)
"$PY" -c "import mpi4py" 2>/dev/null || NEED+=(mpi4py)
[ -n "$MPIEXEC" ] || NEED+=(mpich)
if [ ${#NEED[@]} -gt 0 ]; then
    if [ -d wheels ]; then
        section "offline install from wheels/: ${NEED[*]}"
        "$PY" -m pip install --no-index --find-links wheels "${NEED[@]}" || echo "offline install failed"
        MPIEXEC=$(find_mpiexec)
        echo "which mpiexec: ${MPIEXEC:-<none>}"
    else
        echo "missing: ${NEED[*]}, and no wheels/ directory to install them from"
    fi
fi
HAVE_PYTEST=1
"$PY" -c "import pytest" 2>/dev/null || HAVE_PYTEST=0
LAUNCH=()
if [ -n "$MPIEXEC" ]; then
    LAUNCH=("$MPIEXEC")
    if "$MPIEXEC" --version 2>&1 | grep -qi "open mpi"; then
        LAUNCH+=(--allow-run-as-root --oversubscribe)
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
else
    echo "NOTE: no mpiexec: only the 1-rank checks run, with plain python (steps 2, 3 and the 2-rank benchmark are skipped)"
fi
MULTI_OK=$("$PY" -c "
from collectives._backends import _libnccl, cuda
i = _libnccl.info()
print(1 if i['available'] and tuple(map(int, i['version'].split('.'))) >= cuda.MULTI_RANK_NCCL else 0)" 2>/dev/null || echo 0)

run_tests() {  # name timeout n env... -- runs tests/gpu at n ranks
    local name=$1 limit=$2 n=$3
    shift 3
    section "$name"
    if [ "$HAVE_PYTEST" -eq 0 ]; then
        echo "pytest is missing: running the smoke check instead of tests/gpu"
        local smoke
        smoke=$(mktemp /tmp/gpu_smoke.XXXXXX.py)
        cat >"$smoke" <<'EOF'
import torch, collectives as coll
from collectives._backends import cuda
comm = coll.init()
torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
x = torch.full((1000,), float(comm.rank + 1), device="cuda")
v = x[::2]
assert coll.allreduce(v, "sum") is v
assert (x[::2] == comm.size * (comm.size + 1) / 2).all() and (x[1::2] == comm.rank + 1).all()
assert (coll.broadcast(torch.full((3,), float(comm.rank), device="cuda"), comm.size - 1) == comm.size - 1).all()
assert coll.allgather(torch.ones(2, device="cuda")).shape == (comm.size, 2)
import torch.distributed as dist, collectives.torch_backend
dist.init_process_group("collectives")
t = torch.full((5,), float(comm.rank + 1), device="cuda")
dist.all_reduce(t)
assert (t == comm.size * (comm.size + 1) / 2).all()
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).cuda(), device_ids=[torch.cuda.current_device()])
ddp(torch.ones(3, 4, device="cuda")).sum().backward()
dist.destroy_process_group()
print("smoke ok", comm.rank, cuda.device_transports(comm))
EOF
        if [ ${#LAUNCH[@]} -gt 0 ]; then
            env "$@" timeout "$limit" "${LAUNCH[@]}" -n "$n" "$PY" "$smoke"
        else
            env "$@" timeout "$limit" "$PY" "$smoke"
        fi
        record "$name (smoke)" $?
        return
    fi
    rm -f .test-logs/summary-n"$n"-rank*.json
    if [ ${#LAUNCH[@]} -gt 0 ]; then
        env "$@" timeout "$limit" "${LAUNCH[@]}" -n "$n" "$PY" tests/mpi_pytest.py tests/gpu -q -rs
    else
        env "$@" timeout "$limit" "$PY" tests/mpi_pytest.py tests/gpu -q -rs
    fi
    local rc=$?
    [ $rc -eq 124 ] && echo "TIMEOUT after ${limit}s"
    for f in .test-logs/gpu-n"$n"-rank*.log; do
        [ -f "$f" ] && [ $rc -ne 0 ] && { echo "---- $f (tail) ----"; tail -n 40 "$f"; }
    done
    record "$name" $rc
}

run_tests "1 rank, NCCL" 240 1 COLLECTIVES_DISABLE_NCCL=0
if [ ${#LAUNCH[@]} -eq 0 ]; then
    skip "2 ranks on one GPU, NCCL" "no mpiexec"
    skip "2 ranks, host staging" "no mpiexec"
else
    if [ "$MULTI_OK" = 1 ]; then
        run_tests "2 ranks on one GPU, NCCL" 300 2 NCCL_MULTI_RANK_GPU_ENABLE=1
    else
        skip "2 ranks on one GPU, NCCL" "NCCL is older than 2.30 (or not loadable): it cannot run two ranks on one GPU"
    fi
    run_tests "2 ranks, host staging" 300 2 COLLECTIVES_DISABLE_NCCL=1
fi

section "benchmark, 1 rank"
timeout 180 "$PY" benchmarks/bench_nccl.py --json "$OUTDIR/bench_nccl_n1.json"
record "bench_nccl 1 rank" $?
if [ ${#LAUNCH[@]} -gt 0 ] && [ "$MULTI_OK" = 1 ]; then
    section "benchmark, 2 ranks on one GPU"
    env NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 240 "${LAUNCH[@]}" -n 2 "$PY" benchmarks/bench_nccl.py \
        --json "$OUTDIR/bench_nccl_n2.json"
    record "bench_nccl 2 ranks" $?
else
    skip "bench_nccl 2 ranks" "needs mpiexec and NCCL >= 2.30"
fi

section "training step on CUDA, 1 rank"
timeout 180 "$PY" benchmarks/bench_training.py --device cuda --rounds 5 --steps 5 \
    --json "$OUTDIR/bench_training_cuda_n1.json"
record "bench_training cuda 1 rank" $?
if [ ${#LAUNCH[@]} -gt 0 ] && [ "$MULTI_OK" = 1 ]; then
    section "training step on CUDA, 2 ranks on one GPU (NCCL)"
    env NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 240 "${LAUNCH[@]}" -n 2 "$PY" benchmarks/bench_training.py \
        --device cuda --rounds 5 --steps 5 --json "$OUTDIR/bench_training_cuda_n2.json"
    record "bench_training cuda 2 ranks" $?
else
    skip "bench_training cuda 2 ranks" "needs mpiexec and NCCL >= 2.30"
fi

section "summary"
printf '%s\n' "${RESULTS[@]}"
echo "log: $LOG"
exit $FAILED
