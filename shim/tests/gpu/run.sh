#!/usr/bin/env bash
# The shim on a real GPU: memory limit, cudaMemGetInfo, paced throughput, launch overhead.
#
#   shim/tests/gpu/run.sh            (from anywhere; needs nvcc, an NVIDIA GPU, python3, make, gcc)
#
# Uses GPU 0. Builds libvgpu.so and gpu_check.cu, writes region files with the agent's own
# encoder (vgpu_agent/shm/layout.py, standard library only), runs each check with and without
# the shim preloaded, and prints one summary table. Exit status 0 when every check passed.
# Takes about two minutes plus the nvcc build, and the spill check (1.5x the card, through host
# memory) up to 4 minutes more; every step has a time limit, the whole stays < 10 min.
# VGPU_GPU_SPILL=0 leaves the spill check out. A check that fails or prints nothing is a FAIL
# row; the others still run. Each row is printed as it is made, and the whole table at the end.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SHIM="$(cd "$HERE/../.." && pwd)"
OUT="$SHIM/build/gpu"
WORK="$(mktemp -d /tmp/vgpu-gpu-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit" >&2; exit 2; }
timeout 120 make -s -C "$SHIM" all || exit 2
# built already (nvml_loop.py needs it too): not built again
[[ "$OUT/gpu_check" -nt "$HERE/gpu_check.cu" ]] \
  || timeout 180 nvcc -O2 -o "$OUT/gpu_check" "$HERE/gpu_check.cu" || exit 2
CHECK="$OUT/gpu_check"
SHIM_LIB="$SHIM/build/libvgpu.so"

UUID="$(timeout 60 "$CHECK" uuid)" || { echo "gpu_check cannot reach GPU 0" >&2; exit 2; }
MIB=$((1 << 20))
LIMIT_MIB=1024
CHUNK_MIB=64
SECONDS_EACH=4
GRID=1024
BLOCK=128
SPIN_US=20
POLICY_STRICT=1

region() {  # region NAME MEMORY_LIMIT CORE_PPM RATE BURST POLICY
  python3 "$HERE/make_region.py" "$WORK/$1" "$UUID" "$2" "$3" "$4" "$5" "$6"
  echo "$WORK/$1"
}
said() {  # what a run printed, to the log (stderr), and on to the caller
  local out="$1" rc="$2"; shift 2
  echo "  [$*] exit $rc: $out" >&2
  echo "$out"
}
plain() { local out rc; out="$(env -u LD_PRELOAD timeout 60 "$CHECK" "$@")"; rc=$?; said "$out" "$rc" plain "$@"; }
shimmed() {  # shimmed REGION_DIR ARGS...
  local dir="$1" out rc; shift
  out="$(LD_PRELOAD="$SHIM_LIB" VGPU_REGION_DIR="$dir" VGPU_FAIL_CLOSED=1 timeout 60 "$CHECK" "$@")"
  rc=$?
  said "$out" "$rc" shimmed "$@"
}
# a field's number, 0 when the run printed none (the check then fails, the script goes on)
field() { local v; v="$(sed -n "s/.*$1=\([0-9.]*\).*/\1/p" | head -1)"; echo "${v:-0}"; }

declare -a ROWS
fails=0
row() {
  ROWS+=("$(printf '%-34s %18s %18s  %s' "$1" "$2" "$3" "$4")")
  echo "${ROWS[-1]}"
  [[ "$4" == ok* || "$4" == skipped* ]] || fails=$((fails + 1))
}

# ---- memory: the limit is refused beyond, and cudaMemGetInfo reports inside it
mem_dir="$(region mem $((LIMIT_MIB * MIB)) 1000000 0 0 0)"
base_mem="$(plain mem "$CHUNK_MIB")"
shim_mem="$(shimmed "$mem_dir" mem "$CHUNK_MIB")"
b_alloc=$(($(echo "$base_mem" | field allocated) / MIB))
s_alloc=$(($(echo "$shim_mem" | field allocated) / MIB))
s_refused="$(echo "$shim_mem" | field refused)"
b_total=$(($(echo "$base_mem" | field meminfo_total) / MIB))
s_total=$(($(echo "$shim_mem" | field meminfo_total) / MIB))
s_free=$(($(echo "$shim_mem" | field meminfo_free) / MIB))
verdict="FAIL"
# the context's own memory counts inside the limit too (a few hundred MiB), so the chunks stop
# where the limit less the context is reached: what cudaMemGetInfo shows used (context and
# chunks, while they are held) is within the last chunk below the limit
s_used=$((s_total - s_free))
if (( s_alloc > 0 && s_used <= LIMIT_MIB && s_used > LIMIT_MIB - CHUNK_MIB )) \
   && [[ "$s_refused" == 2 ]]; then
  verdict="ok (refused with cudaErrorMemoryAllocation)"
fi
row "cudaMalloc until refused (MiB)" "$b_alloc" "$s_alloc (+ctx: $s_used) of $LIMIT_MIB" "$verdict"
verdict="FAIL"
(( s_total == LIMIT_MIB && s_free <= LIMIT_MIB )) && verdict="ok"
row "cudaMemGetInfo total / free (MiB)" "$b_total" "$s_total / $s_free" "$verdict"

# ---- memory the driver holds: the context shows inside the limit; pools cannot pass it
ctx_dir="$(region ctxmem $((LIMIT_MIB * MIB)) 1000000 0 0 0)"
b_ctx="$(plain ctxmem)"
s_ctx="$(shimmed "$ctx_dir" ctxmem)"
s_ctx_used=$(($(echo "$s_ctx" | field used) / MIB))
s_ctx_total=$(($(echo "$s_ctx" | field total) / MIB))
verdict="FAIL"
# a context holds a few hundred MiB on current GPUs; counted, it is used inside the limit
(( s_ctx_total == LIMIT_MIB && s_ctx_used >= 32 && s_ctx_used < LIMIT_MIB )) && verdict="ok"
row "context: used inside limit (MiB)" "$(($(echo "$b_ctx" | field used) / MIB)) (whole GPU)" \
    "$s_ctx_used of $s_ctx_total" "$verdict"
pool_dir="$(region pool $((LIMIT_MIB * MIB)) 1000000 0 0 0)"
b_pool="$(plain pool "$CHUNK_MIB" $((2 * LIMIT_MIB)))"
s_pool="$(shimmed "$pool_dir" pool "$CHUNK_MIB" $((2 * LIMIT_MIB)))"
s_async=$(($(echo "$s_pool" | field async) / MIB))
s_second=$(($(echo "$s_pool" | field second) / MIB))
s_held=$(($(echo "$s_pool" | field held) / MIB))
verdict="FAIL"
# the default pool stops below the limit (the context counts too); while it holds that memory a
# second pool gets at most what is left
(( s_async + s_ctx_used <= LIMIT_MIB && s_async > 0 && s_second + s_held <= LIMIT_MIB )) && verdict="ok"
row "async pool, then 2nd pool (MiB)" "$(($(echo "$b_pool" | field async) / MIB)), $(($(echo "$b_pool" | field second) / MIB))" \
    "$s_async, $s_second (held $s_held)" "$verdict"

# ---- throughput: rates giving 25/50/100% of what the GPU does unthrottled
base_tp="$(plain throughput "$SECONDS_EACH" "$GRID" "$BLOCK" "$SPIN_US")"
full="$(echo "$base_tp" | field launches_per_s)"
cost="$(echo "$base_tp" | field cost)"
off_dir="$(region off 0 1000000 0 0 0)"
off_tp="$(shimmed "$off_dir" throughput "$SECONDS_EACH" "$GRID" "$BLOCK" "$SPIN_US" | field launches_per_s)"
verdict="FAIL"
python3 -c "import sys; sys.exit(0 if float('$off_tp') >= 0.95 * float('$full') else 1)" && verdict="ok"
row "launches/s, policy off" "$full" "$off_tp" "$verdict"
for pct in 25 50 100; do
  rate=$(python3 -c "print(int($pct / 100 * float('$full') * $cost))")
  burst=$(python3 -c "print(max($cost, $rate // 20))")
  dir="$(region "rate$pct" 0 $((pct == 100 ? 999999 : pct * 10000)) "$rate" "$burst" "$POLICY_STRICT")"
  got="$(shimmed "$dir" throughput "$SECONDS_EACH" "$GRID" "$BLOCK" "$SPIN_US" | field launches_per_s)"
  share=$(python3 -c "print(round(100 * float('$got') / float('$full'), 1))")
  verdict="FAIL"
  python3 -c "import sys; sys.exit(0 if abs($share - $pct) <= max(5, 0.1 * $pct) else 1)" && verdict="ok"
  row "launches/s at a rate for $pct%" "$full (100%)" "$got ($share%)" "$verdict"
done

# ---- cuGetProcAddress: both flags hand out the hooks (through the runtime's entry-point lookup)
pa_dir="$(region procaddr 0 500000 $((1 << 61)) $((1 << 61)) "$POLICY_STRICT")"
pa="$(shimmed "$pa_dir" procaddr)"
pa_def="$(echo "$pa" | sed -n 's/.*default=\([0-9]*\/[0-9]*\).*/\1/p')"
pa_pt="$(echo "$pa" | sed -n 's/.*per_thread=\([0-9]*\/[0-9]*\).*/\1/p')"
verdict="FAIL"
[[ -n "$pa_def" && "${pa_def%/*}" == "${pa_def#*/}" && "${pa_pt%/*}" == "${pa_pt#*/}" ]] && verdict="ok"
row "entry points hooked (default / pt)" "-" "$pa_def / $pa_pt" "$verdict"

# ---- graphs: a captured graph of GRAPH_N kernels is paced like its kernels (25/50/100%)
GRAPH_N=20
base_g="$(plain graph "$SECONDS_EACH" "$GRID" "$BLOCK" "$SPIN_US" "$GRAPH_N")"
gfull="$(echo "$base_g" | field kernels_per_s)"
gcost="$(echo "$base_g" | field cost)"
for pct in 25 50 100; do
  rate=$(python3 -c "print(int($pct / 100 * float('$gfull') * $gcost))")
  burst=$(python3 -c "print(max($gcost * $GRAPH_N, $rate // 20))")
  dir="$(region "graph$pct" 0 $((pct == 100 ? 999999 : pct * 10000)) "$rate" "$burst" "$POLICY_STRICT")"
  got="$(shimmed "$dir" graph "$SECONDS_EACH" "$GRID" "$BLOCK" "$SPIN_US" "$GRAPH_N" | field kernels_per_s)"
  share=$(python3 -c "print(round(100 * float('$got') / float('$gfull'), 1))")
  verdict="FAIL"
  python3 -c "import sys; sys.exit(0 if abs($share - $pct) <= max(5, 0.1 * $pct) else 1)" && verdict="ok"
  row "graph kernels/s at a rate for $pct%" "$gfull (100%)" "$got ($share%)" "$verdict"
done
# capture with an empty bucket (1 token/s): recording spends nothing, so it does not wait
empty_dir="$(region empty 0 500000 1 1 "$POLICY_STRICT")"
b_cap="$(echo "$base_g" | field capture_ms)"
s_cap="$(shimmed "$empty_dir" graph 0 "$GRID" "$BLOCK" "$SPIN_US" "$GRAPH_N" | field capture_ms)"
verdict="FAIL"
python3 -c "import sys; sys.exit(0 if float('$s_cap') < float('$b_cap') + 50 else 1)" && verdict="ok"
row "capture $GRAPH_N kernels, empty bucket (ms)" "$b_cap" "$s_cap" "$verdict"

# ---- launch overhead (host time per launch of an empty kernel)
ample_dir="$(region ample 0 500000 $((1 << 61)) $((1 << 61)) "$POLICY_STRICT")"
b_ns="$(plain overhead 100000 | field ns_per_launch)"
s_ns="$(shimmed "$ample_dir" overhead 100000 | field ns_per_launch)"
added=$(python3 -c "print(round(float('$s_ns') - float('$b_ns'), 1))")
row "host ns per launch (tokens ample)" "$b_ns" "$s_ns" "ok (+$added ns)"

# ---- spill: a limit of 1.5x the card with the spill flag; the part past the card is managed
# memory (host memory once evicted), so the host needs about half a card free
card_mib=$(($(echo "$base_mem" | field meminfo_total) / MIB))
spill_mib=$((card_mib * 3 / 2))
spill_chunk=1024
avail_mib=$(($(sed -n 's/^MemAvailable: *\([0-9]*\) kB/\1/p' /proc/meminfo) / 1024))
if [[ "${VGPU_GPU_SPILL:-1}" == 0 ]]; then
  row "spill 1.5x card: touch GB/s" "-" "-" "skipped (VGPU_GPU_SPILL=0)"
elif (( avail_mib < spill_mib - card_mib + 8192 )); then
  row "spill 1.5x card: touch GB/s" "-" "-" "skipped (host memory ${avail_mib} MiB free)"
else
  spill_dir="$(python3 "$HERE/make_region.py" "$WORK/spill" "$UUID" $((spill_mib * MIB)) 1000000 0 0 0 1 \
               && echo "$WORK/spill")"
  s_spill="$(LD_PRELOAD="$SHIM_LIB" VGPU_REGION_DIR="$spill_dir" VGPU_FAIL_CLOSED=1 timeout 240 \
             "$CHECK" spill "$spill_chunk" "$spill_mib" 2)"
  said "$s_spill" "$?" shimmed spill >/dev/null
  sp_alloc=$(($(echo "$s_spill" | field allocated) / MIB))
  sp_managed="$(echo "$s_spill" | field managed_chunks)"
  sp_total=$(($(echo "$s_spill" | field meminfo_total) / MIB))
  sp_free=$(($(echo "$s_spill" | field meminfo_free) / MIB))
  sp_gbps="$(echo "$s_spill" | field spill_gbps)"
  dev_gbps="$(echo "$s_spill" | field device_gbps)"
  sp_ok="$(echo "$s_spill" | field correct)"
  verdict="FAIL"
  # the whole 1.5x was served (less the context's share), part of it managed, the info inside
  # the limit, and the data right
  if (( sp_alloc + spill_chunk * 2 >= spill_mib && sp_managed > 0 && sp_total == spill_mib
        && sp_free <= spill_mib )) && [[ "$sp_ok" == 1 ]]; then
    verdict="ok ($sp_alloc MiB, $sp_managed GiB managed; info $sp_total/$sp_free MiB)"
  fi
  row "spill 1.5x card: touch GB/s" "$dev_gbps (device)" "$sp_gbps (spilled)" "$verdict"
fi

echo
echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0 2>/dev/null || echo unknown), $UUID"
echo "CUDA: $(nvcc --version | tail -1)"
printf '%-34s %18s %18s  %s\n' "check" "without shim" "with shim" "result"
printf '%s\n' "${ROWS[@]}"
exit $(( fails > 0 ))
