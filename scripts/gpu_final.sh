#!/bin/bash
# Usage (GPU host): bundle with cuda_plan_test, cuda_allgather_channel_test, cuda_channel_test and
# cuda_vmm_test (deploy/bundle/make_bundle.sh), copy this script into it, run it; OUT= for logs.
# Final GPU regression run (lead): plans, channel AllGather, channels, VMM, under MPS.
B=$(cd "$(dirname "$0")" && pwd)
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$B/lib:$NCCL:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
O=${OUT:-/tmp/out}; mkdir -p $O
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
L=$O/final_mps1.txt
step() { local n=$1 t=$2; shift 2; echo "##### $n" >> $L; local s=$SECONDS; timeout $t "$@" >> $L 2>&1; echo "$n rc=$? $((SECONDS-s))s" | tee -a $L; }
step plan 60 $B/bin/cuda_plan_test --qtxd=$B/bin/qtxd
step allgather 90 $B/bin/cuda_allgather_channel_test --qtxd=$B/bin/qtxd
QTX_CHANNEL_TEST_ITERS=200 step channel 60 $B/bin/cuda_channel_test --qtxd=$B/bin/qtxd --gtest_filter=-*ClientKilled*
step vmm 60 $B/bin/cuda_vmm_test --qtxd=$B/bin/qtxd --gtest_filter=-*Kill*
echo quit | timeout 10 nvidia-cuda-mps-control
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
grep -hE "^\[  (PASSED|FAILED) |^\{|^[a-z]+ rc=" $L | head -60
