#!/bin/bash
# GPU host: the torch_quantized_linear example through qtx.cuda (zero-copy, stream-ordered), from the repository root with a bundle B of scripts/make_gpu_python_bundle.sh whose bin/_native*.so is copied into B/py/qtx/: B/example.sh OUT;
# against a CUDA qtxd under MPS, one H200.
B=$(cd "$(dirname "$0")" && pwd); O=${1:?out}; mkdir -p "$O"
rm -f "$B/lib/libstdc++.so.6" "$B/lib/libgcc_s.so.1"
NCCL=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$B/lib:$NCCL:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d
"$B/bin/qtxd" --device=cuda:0 --allow_client_shm --socket=/tmp/qtxd-ex.sock --log_level=warn > "$O/qtxd.log" 2>&1 &
for i in $(seq 80); do [ -S /tmp/qtxd-ex.sock ] && break; sleep 0.25; done; sleep 0.5
timeout 240 python3 examples/torch_quantized_linear/train.py --target unix:///tmp/qtxd-ex.sock \
  --python_dir "$B/py" --quantizer cuda --device cuda --steps 100 --log_every 10 --check \
  --json "$O/example.jsonl" > "$O/example.txt" 2>&1; echo "example rc=$?" | tee -a "$O/example.txt"
kill %1; wait; echo quit | nvidia-cuda-mps-control
tail -25 "$O/example.txt"
