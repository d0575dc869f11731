#!/usr/bin/env bash
# Second device call: the 8B shape (2 layers) in f32 at tp 2, 3, 4 and in bf16 under
# --numerics invariant, tp 1 vs tp N on the GPU; then a decode profile of TinyLlama.
set -uo pipefail
mkdir -p target/dc2
export LD_LIBRARY_PATH=$(python3 -c 'import glob,nvidia;print(":".join(sorted({d for b in nvidia.__path__ for d in glob.glob(b+"/*/lib")})))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
show() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1])); print({k:v for k,v in d.items() if k not in ('prompt',)})" "$1" 2>&1 | cut -c1-600; }
{
for tp in 2 3 4; do
  echo "== verify f32 8B shape tp $tp"
  timeout 100 dist/tpc verify models/llama3-8b-f32.ron --layers 2 --tp $tp --prompt-len 96 --device cuda --json > target/dc2/f32-tp$tp.json 2> target/dc2/f32-tp$tp.err; echo "rc $?"
  show target/dc2/f32-tp$tp.json; tail -n 3 target/dc2/f32-tp$tp.err
done
echo "== verify bf16 8B shape tp 2 --numerics invariant"
timeout 100 dist/tpc verify models/llama3-8b.ron --layers 2 --tp 2 --prompt-len 96 --numerics invariant --device cuda --json > target/dc2/inv-tp2.json 2> target/dc2/inv-tp2.err; echo "rc $?"
show target/dc2/inv-tp2.json; tail -n 3 target/dc2/inv-tp2.err
echo "== bench tinyllama tp1 bf16 batch 1 --profile"
timeout 120 dist/tpc bench models/tinyllama-1.1b.ron --device cuda --prompt-len 128 --max-new-tokens 64 --repeat 1 --profile 2>&1 | tail -n 40
} > target/dc2/second.txt 2>&1
cp target/dc2/second.txt "$OUT/"
cat "$OUT/second.txt"
