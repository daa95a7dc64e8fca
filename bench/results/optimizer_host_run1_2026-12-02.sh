#!/bin/bash
# Device run 1 (issue 16, host AdamW at memory speed): host facts, bit-exact
# tests, then optimizer_vs_torch.py with every binary of bin/ (A/B, 3 rounds,
# phases in round 0) next to torch's fused CPU AdamW. From the repo root:
#   bash bundle-adamw/run1.sh      (results under $OUT)
B=bundle-adamw
export LD_LIBRARY_PATH=$PWD/$B/lib
{
  date -u; nproc; lscpu; echo; ls /sys/devices/system/node; command -v perf || echo "perf: not installed"
  getconf -a | grep -i CACHE; grep -m1 'model name' /proc/cpuinfo; grep -m1 MHz /proc/cpuinfo
  grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  head -3 /proc/meminfo; grep -i huge /proc/meminfo
  for f in enabled defrag shmem_enabled; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>&1)"; done
 python3 -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())'
} > $OUT/env.txt 2>&1
{
  $B/bin/kernels_cpu_adamw_test; echo "rc(as is)=$?"
  QTX_ADAMW_ISA=baseline $B/bin/kernels_cpu_adamw_test; echo "rc(baseline)=$?"
} > $OUT/tests.txt 2>&1
tail -2 $OUT/tests.txt
# bind: the scratch binary with OpenMP threads pinned one per core; thp: the
# scratch binary with its arrays on transparent huge pages (--thp).
cat > /tmp/bind.sh <<EOS
#!/bin/bash
OMP_PROC_BIND=close OMP_PLACES=cores exec $PWD/$B/bin/optimizer_cpu_bench_scratch "\$@"
EOS
cat > /tmp/thp.sh <<EOS
#!/bin/bash
exec $PWD/$B/bin/optimizer_cpu_bench_scratch "\$@" --thp
EOS
chmod +x /tmp/bind.sh /tmp/thp.sh
export OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
benches="--bench=before=$B/bin/optimizer_cpu_bench_before --bench=scratch=$B/bin/optimizer_cpu_bench_scratch"
for v in t8 t16 t2 pf0; do benches="$benches --bench=$v=$B/bin/optimizer_cpu_bench_$v"; done
benches="$benches --bench=bind=/tmp/bind.sh --bench=thp=/tmp/thp.sh"
set -o pipefail
timeout 380 python3 $B/optimizer_vs_torch.py $benches --max_threads=16 --reps=7 --rounds=2 \
  --grad=fp32 --torch_impls=fused --phases > $OUT/run1.jsonl 2> $OUT/run1.err
echo "rc=$?"
grep adamw_vs_torch $OUT/run1.jsonl | cut -c1-330
