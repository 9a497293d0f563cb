#!/usr/bin/env bash
# Runs on the GPU machine from .gpubundle/ (see scripts/gpu-bundle): every GPU
# test, then every kernel benchmark; logs and JSON go to $OUT (default ./out).
# STEPS picks the parts (default "tests codec attention sdpa daemon"; "startup"
# times kvtierd's start with 8 and 24 GiB pools; "hf" runs
# kvtier.hf's tests and bench/e2e_prefix_reuse.py, about 3 minutes): one
# device call is limited to 10 minutes, and the codec bench alone takes
# about 5 (12 formats), so a call that needs the other numbers too leaves
# "codec" out. "daemon" starts kvtierd on a temporary socket (DRAM tier, NVMe
# tier in a temporary folder), runs the Python GPU tests (which start their
# own kvtierd) and gpu_daemon_bench against it. "engines" runs the engine
# connectors' core (kvtier.engine) on CUDA and CPU caches, under a minute.
# "daemon-huge" runs the daemon bench again with kvtierd's pool in huge pages.
# "interference" (with "daemon") then times a decode-like CUDA graph step alone
# and beside each part of a store and paced copies (gpu_interference_bench.py),
# about a minute and a half. "trace" (with "daemon") also writes a Chrome
# trace of single k16v8 stores and loads ($OUT/gpu_daemon-trace.json).
# "fidelity" runs bench/fidelity_bench.py on the real models staged there.
set -uo pipefail
STEPS=" ${STEPS:-tests codec attention sdpa daemon} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
cd "$(dirname "$0")"
OUT=${OUT:-./out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/lib:$PWD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# scripts/gpu-bundle packs the binaries (Python's lzma, where xz is missing).
[[ -f bins.tar.gz ]] && tar xzf bins.tar.gz
[[ -f bins.tar.xz ]] && python3 -c 'import tarfile; tarfile.open("bins.tar.xz").extractall()'

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
rc=0
if step tests; then
  for t in kernels_ref_test kernels_launch_test kernels_gpu_test server_gpu_test; do
    [[ -x ./$t ]] || continue
    # A hung kernel (e.g. a barrier never completing) fails its step, not the run.
    timeout 300 ./$t --gtest_output=json:"$OUT/$t.json" >"$OUT/$t.log" 2>&1 || rc=1
    tail -n 3 "$OUT/$t.log"
  done
fi
if step codec; then
  timeout 480 ./kernel_codec_bench "$OUT/codec.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
if step attention && [[ -x ./kernel_attention_bench ]]; then
  timeout 420 ./kernel_attention_bench "$OUT/attention.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
if step sdpa; then
  PYTHONUNBUFFERED=1 python3 kernel_sdpa_bench.py "$OUT/sdpa.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
# kvtierd on a temporary socket (8 GiB DRAM tier, NVMe in a temporary
# folder), the Python GPU tests (when $2 is "tests") and gpu_daemon_bench
# against it, its JSON as $OUT/$1.json; the rest of the arguments go to kvtierd.
daemon_bench() {
  local name=$1 tests=$2
  shift 2
  local tmp
  tmp=$(mktemp -d /tmp/kvtierd-XXXXXX)
  ./kvtierd --data-dir "$tmp" --socket "$tmp/kvtierd.sock" --dram-gib 8 --nvme-gib 4 \
    --dram-populate true --ready-file "$tmp/ready" --log-level warn "$@" >"$OUT/$name-kvtierd.log" 2>&1 &
  local daemon=$!
  for _ in $(seq 100); do [[ -f "$tmp/ready" ]] && break; sleep 0.1; done
  export KVTIERD=$PWD/kvtierd KVTIER_LIBRARY=$PWD/libkvtier.so PYTHONPATH=$PWD/python
  if [[ "$tests" == tests ]]; then
    PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs python/tests/test_torch_gpu.py \
      >"$OUT/python_gpu_test.log" 2>&1 || rc=1
    tail -n 5 "$OUT/python_gpu_test.log"
  fi
  if [[ -f "$tmp/ready" ]]; then
    local trace=()
    step trace && trace=("$OUT/$name-trace.json")
    PYTHONUNBUFFERED=1 timeout 300 python3 gpu_daemon_bench.py "$tmp/kvtierd.sock" \
      "$OUT/$name.json" "${trace[@]}" 2>&1 | tee -a "$OUT/bench.log" || rc=1
    if step interference && [[ "$name" == gpu_daemon ]]; then
      PYTHONUNBUFFERED=1 timeout 240 python3 gpu_interference_bench.py "$tmp/kvtierd.sock" \
        "$OUT/interference.json" 2>&1 | tee -a "$OUT/bench.log" || rc=1
    fi
  else
    echo "kvtierd did not start" | tee -a "$OUT/bench.log"; cat "$OUT/$name-kvtierd.log"; rc=1
  fi
  kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null
  rm -rf "$tmp"
}
if step daemon; then
  daemon_bench gpu_daemon tests
fi
# "daemon-huge": the same bench with kvtierd's pool in huge pages (reserved
# here, as root: 8 GiB and a margin).
if step daemon-huge; then
  if echo 4160 >/proc/sys/vm/nr_hugepages 2>/dev/null; then
    daemon_bench gpu_daemon_huge no --dram-huge-pages true
    echo 0 >/proc/sys/vm/nr_hugepages
  else
    echo "daemon-huge: cannot reserve huge pages (not root?)" | tee -a "$OUT/bench.log"; rc=1
  fi
fi

if step startup; then
  # kvtierd's time to ready (ready file written) and to a populated DRAM pool
  # (its log line), for pools of 8 and 24 GiB: startup.json.
  tmp=$(mktemp -d /tmp/kvtierd-XXXXXX)
  for gib in 8 24; do
    log="$OUT/kvtierd-startup-$gib.log"
    t0=$(date +%s.%N)
    ./kvtierd --data-dir "$tmp/d$gib" --socket "$tmp/s$gib.sock" --dram-gib "$gib" --nvme-gib 1 \
      --dram-populate true --ready-file "$tmp/ready$gib" --log-level info >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 6000); do [[ -f "$tmp/ready$gib" ]] && break; sleep 0.005; done
    t1=$(date +%s.%N)
    for _ in $(seq 1200); do grep -q "pool populated" "$log" && break; sleep 0.05; done
    t2=$(date +%s.%N)
    echo "$gib $t0 $t1 $t2" >>"$tmp/times"
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  done
  python3 - "$tmp/times" "$OUT/startup.json" <<'PY' | tee -a "$OUT/bench.log"
import json, sys
rows = []
for line in open(sys.argv[1]):
    gib, t0, t1, t2 = line.split()
    rows.append({"dram_gib": int(gib), "ready_s": float(t1) - float(t0),
                 "populated_s": float(t2) - float(t0)})
json.dump({"startup": rows}, open(sys.argv[2], "w"), indent=2)
for r in rows:
    print(f"kvtierd --dram-gib {r['dram_gib']}: ready {r['ready_s']:.2f} s, "
          f"pool populated {r['populated_s']:.2f} s")
PY
  rm -rf "$tmp"
fi
if step hf; then
  # kvtier.hf: its tests (GPU ones included; each starts its own kvtierd), then
  # the end-to-end prefix-reuse benchmark (its own kvtierd, restarted for NVMe).
  export KVTIERD=$PWD/kvtierd KVTIER_LIBRARY=$PWD/libkvtier.so
  (cd python/tests && PYTHONUNBUFFERED=1 timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
    test_hf.py >"$OUT/python_hf_test.log" 2>&1) || rc=1
  tail -n 5 "$OUT/python_hf_test.log"
  PYTHONUNBUFFERED=1 timeout 330 python3 bench/e2e_prefix_reuse.py --kvtierd "$PWD/kvtierd" \
    --out "$OUT/e2e_prefix_reuse.json" 2>&1 | tee -a "$OUT/bench.log" | tail -n 40 || rc=1
fi
if step fidelity; then
  # kvtier.fidelity on real models through the GPU path: the GGUFs of
  # python/models.json, staged with scripts/gpu-stage into $KVTIER_MODELS
  # (default /tmp/kvtier-stage/models); FIDELITY_ARGS adds arguments
  # (e.g. "--model qwen2.5-coder-1.5b").
  python3 -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 KVTIER_LIBRARY=$PWD/libkvtier.so timeout 540 \
    python3 bench/fidelity_bench.py --kvtierd "$PWD/kvtierd" \
    --models "${KVTIER_MODELS:-/tmp/kvtier-stage/models}" --out "$OUT/fidelity.json" \
    ${FIDELITY_ARGS:-} 2>&1 | tee -a "$OUT/fidelity.log" | tail -n 60 || rc=1
fi
if step engines; then
  # kvtier.engine: the vLLM connector's worker calls on CUDA caches (needs no vLLM).
  export KVTIERD=$PWD/kvtierd KVTIER_LIBRARY=$PWD/libkvtier.so
  (cd python/tests && PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
    test_engine_core_gpu.py test_engine_core.py >"$OUT/python_engines_test.log" 2>&1) || rc=1
  tail -n 5 "$OUT/python_engines_test.log"
fi
python3 kernel_merge_results.py "$OUT" || rc=1
if step tests; then grep -h -E "FAILED|PASSED|SKIPPED" "$OUT"/*_test.log | head -40; fi
if step daemon; then grep -h -E "passed|failed|error" "$OUT"/python_gpu_test.log | tail -5; fi
# The device tool brings back at most 8 files: the logs and the tests' JSON
# travel as one archive (the benches' JSON stay beside it).
(cd "$OUT" && shopt -s nullglob && logs=(*.log *_test.json) &&
  if ((${#logs[@]})); then tar czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}"; fi)
exit $rc
