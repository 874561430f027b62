#!/usr/bin/env bash
# Where the CPU of the TCP path goes: the ring over two emulated hosts (`scripts/cluster.sh
# perf 2 1`: network namespaces, veth links through a bridge, tbf shaping, all on this
# machine's cores), all_reduce of 64 MiB float, sampled with `perf record -a -g` in the second
# half of the run (the timed loop) at each rate. Prints, per rate, the share of the oxccl ranks' own samples
# (self time) in: the kernel's copy into socket buffers on send (`_copy_from_iter`), its copy
# out of them on receive (`_copy_to_iter`), the rest of the kernel, oxccl's reduction
# (`reduce::kernel*`), the rest of user space and the benchmark's own buffer fill; and the
# ranks' share of all samples.
#
# Usage (root, perf): scripts/tcp_profile.sh [RATE ...]   (default: 10gbit 2500mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "perf is needed (Debian: linux-perf)" >&2; exit 1; }
cargo build --release -q -p oxccl-cli
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(10gbit 2500mbit)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| rate | kernel: send copy | kernel: receive copy | kernel: the rest | oxccl: reduction | oxccl: the rest of user space | the benchmark's buffer fill | the ranks' share of all samples |"
echo "|---|---|---|---|---|---|---|---|"
for rate in "${rates[@]}"; do
  data="$tmp/$rate.data"
  # The whole run is sampled; the report takes its second half, inside the timed loop (the
  # buffers' fill and the warm-up calls come before it, the namespaces' set-up is no rank's).
  OXCCL_CLUSTER_RATE=$rate perf record -q -a -g -o "$data" -- \
    scripts/cluster.sh perf 2 1 all_reduce -b 64M -e 64M -n 80 -w 2 -c 0 \
    >"$tmp/$rate.log" 2>&1 || { cat "$tmp/$rate.log" >&2; exit 1; }
  report() { perf report -i "$data" --stdio --no-children -g none --time 50%-100% "$@" 2>/dev/null; }
  report --sort comm >"$tmp/$rate.comm"
  report --comms oxccl --sort sym >"$tmp/$rate.sym"
  python3 - "$rate" "$tmp/$rate.comm" "$tmp/$rate.sym" <<'EOF'
import re, sys
rate, comm_file, sym_file = sys.argv[1:]
with open(comm_file) as f:
    comm = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s*([\d.]+)%\s+(\S+)\s*$", f.read(), re.M)}
cats = {"send": 0.0, "recv": 0.0, "kernel": 0.0, "reduce": 0.0, "user": 0.0, "fill": 0.0}
# The benchmark fills its buffers before each placement's loop (out of place, then in place):
# the fill of the second falls inside the sampled half. Its functions are counted apart.
fill = ("oxccl::comm::check::", "__fixdfti", "trunc", "__memset")
with open(sym_file) as f:
    syms = f.read()
for m in re.finditer(r"^\s*([\d.]+)%\s+\[(k|\.)\]\s+(.*?)\s*$", syms, re.M):
    pct, where, sym = float(m.group(1)), m.group(2), m.group(3)
    if where == "k":
        key = "send" if sym == "_copy_from_iter" else "recv" if sym == "_copy_to_iter" else "kernel"
    else:
        key = "reduce" if "reduce::kernel" in sym else "fill" if sym.startswith(fill) else "user"
    cats[key] += pct
total = sum(cats.values()) or 1.0
cells = " | ".join(f"{100 * cats[k] / total:.0f} %" for k in ("send", "recv", "kernel", "reduce", "user", "fill"))
print(f"| {rate} | {cells} | {comm.get('oxccl', 0.0):.1f} % |")
EOF
done
