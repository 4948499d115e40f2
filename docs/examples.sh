#!/usr/bin/env bash
# Regenerates the pictures in docs/img/ that the README shows. Run from the repo root with zsim installed.
set -euo pipefail
out=docs/img
tmp=$(mktemp -d)
zsim compare scenarios/seed004-zero2-64gpu.yaml --quiet --plot $out/compare.png --json $tmp/compare.json
zsim sweep scenarios/seed004-zero2-64gpu.yaml --quiet --csv $tmp/scaling.csv \
  --vary hardware.nodes=1,2,4,8,16,32,64,128 --vary deepspeed.zero_optimization.stage=1,2,3
zsim plot $tmp/scaling.csv --kind scaling --out $out/scaling.png \
  --title "Llama-2 7B, seq 4096, micro-batch 2: scaling on DGX A100 80GB"
zsim plot $tmp/compare.json --kind memory --out $out/memory.png --title "Llama-2 7B on 64 A100: memory per variant"
zsim sweep scenarios/seed004-zero3-auto-64gpu.yaml --quiet --json $tmp/zeropp.json \
  --set training.seq_len=1024 --set training.micro_batch_size=1 \
  --vary hardware.override.inter_node.nic_bw_Gbps=50,100,200,400 \
  --vary deepspeed.zero_optimization.zero_hpz_partition_size=1,8 \
  --vary deepspeed.zero_optimization.zero_quantized_gradients=false,true
zsim plot $tmp/zeropp.json --kind curves --x hardware.override.inter_node.nic_bw_Gbps --out $out/zeropp.png \
  --title "Llama-2 7B ZeRO-3 on 64 A100, 1 x 1024 tokens a GPU: ZeRO++ across NIC bandwidth"
zsim run scenarios/seed004-zero3-auto-64gpu.yaml --quiet --trace $tmp/trace.json
zsim plot $tmp/trace.json --kind timeline --out $out/timeline.png \
  --title "One ZeRO-3 step of Llama-2 7B on 64 A100 (per stream)"
zsim plot $tmp/trace.json --kind memory-timeline --out $out/memory-timeline.png --title "GPU memory over the same step"
rm -rf "$tmp"
