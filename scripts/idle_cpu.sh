#!/usr/bin/env bash
# Idle CPU of an `mpirun -np 4 rackfill serve` group (docs/deploy.md, "An idle group idles"): the
# ranks' CPU time from /proc over 5 s idle, involuntary context switches, then the latency of
# one-token requests after IDLE seconds idle (default 2) and back to back. Usage:
# bash scripts/idle_cpu.sh BINARY PORT [IDLE] (a binary built with --features mpi).
bin=$1; port=$2; idle=${3:-2}
RUST_LOG=warn mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 $bin serve --port $port > /tmp/idle-$port.log 2>&1 &
for i in $(seq 1 120); do curl -fsS localhost:$port/health >/dev/null 2>&1 && break; sleep 0.5; done
sleep 3
pids=$(ps -eo pid,args | grep "$bin serve --port $port" | grep -v grep | grep -v mpirun | awk '{print $1}')
tick=$(getconf CLK_TCK)
cpu() { for p in $pids; do awk '{print $14+$15}' /proc/$p/stat; done | paste -sd+ | bc; }
cs() { for p in $pids; do grep nonvoluntary_ctxt /proc/$p/status | awk '{print $2}'; done | paste -sd+ | bc; }
t0=$(cpu); c0=$(cs); sleep 5; t1=$(cpu); c1=$(cs)
echo "processes: $(echo $pids | wc -w); CPU over 5 s idle: $(echo "scale=1; ($t1-$t0)*100/$tick/5" | bc)% of one core (all ranks together); involuntary switches/s: $(( (c1-c0)/5 ))"
for i in 1 2 3; do sleep "$idle"; curl -s -o /dev/null -w "first request after $idle s idle: %{time_total}s\n" localhost:$port/v1/completions -H 'content-type: application/json' -d '{"model":"rackfill-tiny-moe","prompt":"Hello","max_tokens":1}'; done
for i in 1 2 3; do curl -s -o /dev/null -w "back to back: %{time_total}s\n" localhost:$port/v1/completions -H 'content-type: application/json' -d '{"model":"rackfill-tiny-moe","prompt":"Hello","max_tokens":1}'; done
pkill -f "port $port"; sleep 1
