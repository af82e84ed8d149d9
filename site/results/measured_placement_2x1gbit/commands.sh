#!/bin/bash
# The script as run for this sitting (2026-12-04, from /work/main with its dev venv; outputs under /tmp/meas, each
# bench's bench.json/txt copied here). flow+rows at 1/10 with layers placed by the estimates or, after 5 timed
# steps, by the measured preconditioning (kfac.placement_steps=5), alternating, on the emulated 2-node cluster.
# ResNet-18's +measured-0 and +measured-1 ran the code as it was then, which moved layers whatever that saved;
# its +measured-long and every ResNet-50 run the committed code, which moves them only to save 1 % of a period
# (each run's placement line in periods.txt says which).
cd /work/main
. /work/venv/bin/activate
mkdir -p /tmp/meas
bench() {  # name recipe profile extra-args...
  local name=$1 recipe=$2 prof=$3; shift 3
  python tools/bench.py $recipe kfac.profile_steps=2 --ablation measured --cluster --nodes 2 --nproc 1 --rate 1gbit \
    --intervals 1/10 --steps 30 --warmup 10 --reps 2 --profile $prof --out /tmp/meas/bench_$name "$@" \
    > /tmp/meas/bench_$name.log 2>&1
  echo "bench $name rc=$? $(date +%T)"
}
R18="recipes/resnet18_synthetic.yaml"; P18=docs/results/resnet18_2x1gbit/profile.yaml
R50="recipes/resnet50_spd.yaml data.image_size=32"; P50=docs/results/resnet50_2x1gbit/profile.yaml
bench r18 $R18 $P18
bench r50 "$R50" $P50 --no-outside-clock
# Then, from the traced windows of docs/results/bound_windows_2x1gbit (no run needed):
T=docs/results/bound_windows_2x1gbit/traces
for m in r18 r50; do echo -n "$m: "; python tools/placement_floor.py $T/${m}_1_10_inv.json $T/${m}_1_10_between.json \
  --every 10; done > docs/results/measured_placement_2x1gbit/floor.txt
