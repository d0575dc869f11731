#!/usr/bin/env bash
# The first call on a lent GPU machine (run from the repository root, dist/ and
# target/verify-cpu.json carried): versions, smoke runs at tp 1-3, an 8B-shape tp 1 vs tp 2 verify
# (against the CPU's tokens in target/verify-cpu.json), then scripts/device_check.sh; results in $OUT.
set -uo pipefail
mkdir -p target/dc
export LD_LIBRARY_PATH=$(python3 -c 'import glob,nvidia;print(":".join(sorted({d for b in nvidia.__path__ for d in glob.glob(b+"/*/lib")})))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
python3 -c 'import ctypes as c,glob,nvidia;n=c.CDLL([p for b in nvidia.__path__ for p in glob.glob(b+"/cu13/lib/libnvrtc.so.13")][0]);a,b,v=c.c_int(),c.c_int(),c.c_int();n.nvrtcVersion(c.byref(a),c.byref(b));c.CDLL("libcuda.so.1").cuDriverGetVersion(c.byref(v));print("nvrtc",a.value,b.value,"driver",v.value)'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch;print("torch",torch.__version__,torch.version.cuda)'
ls "$(python3 -c 'import nvidia;print(nvidia.__path__[0])')"/*/lib 2>&1 | grep -E 'nccl|nvrtc|cublas' | head
for tp in 1 2 3; do
  echo "== smoke tp $tp"
  CUDA_LAUNCH_BLOCKING=1 timeout 60 dist/tpc run tests/fixtures/checkpoints/llama-gqa --tp $tp --device cuda --prompt-ids 1,2,3 --max-new-tokens 4 2>&1 | tail -n 15
  echo "rc $?"
done
echo "== verify 8B shape, 2 layers, tp 2"
timeout 90 dist/tpc verify models/llama3-8b.ron --layers 2 --tp 2 --prompt-len 96 --device cuda --json > target/dc/verify-gpu.json 2> target/dc/verify-gpu.err
echo "rc $?"; tail -n 5 target/dc/verify-gpu.err
python3 - <<'P'
import json
try:
    g=json.load(open("target/dc/verify-gpu.json")); c=json.load(open("target/verify-cpu.json"))
    print({k:g.get(k) for k in ("rel_error","max_abs_error","tokens_tp1","tokens_tpn","passed")}, "cpu tokens_tp1", c["tokens_tp1"], "same:", g.get("tokens_tp1")==c["tokens_tp1"])
except Exception as e:
    print("verify compare failed:", e)
P
} > target/dc/first.txt 2>&1
cp target/dc/first.txt "$OUT/"
OUT=target/dc PARITY_JOBS=8 TPS="1 2 3 4 8" SPEED_MODELS=models/tinyllama-1.1b.ron BUDGET_S=${BUDGET_S:-300} timeout $(( ${BUDGET_S:-300} + 40 )) scripts/device_check.sh > target/dc/check.log 2>&1
echo "device_check rc $?" >> target/dc/check.log
cp target/dc/device_check.md "$OUT/" 2>/dev/null
tail -n 60 target/dc/check.log > "$OUT/check-tail.log"
tar -czf "$OUT/dc.tgz" target/dc 2>/dev/null
cat "$OUT/first.txt"; cat "$OUT/device_check.md" 2>/dev/null | head -120
