#!/bin/bash
# The script as run for this sitting (2026-12-03, from /work/main with its dev venv; outputs under /tmp/bound2, the
# files kept copied from there: traces/NAME.json = NAME/run/*/layers.json, bench_*/ = bench.json/txt).
# Traced windows of flow+rows (inverting steps, and steps between) at both intervals, on the emulated cluster.
cd /work/main
. /work/venv/bin/activate
trace() {  # name recipe profile F I steps first count every
  local name=$1 recipe=$2 prof=$3 f=$4 i=$5 steps=$6 first=$7 count=$8 every=$9; shift 9
  python tools/cluster.py --nodes 2 --threads 1 -- run.py $recipe kfac.profile_steps=2 kfac.profile=$prof \
    kfac.variant=flow kfac.precondition=rows kfac.factor_update_freq=$f kfac.inv_update_freq=$i train.steps=$steps \
    train.timeline=$first train.timeline_steps=$count train.timeline_every=$every train.save=false \
    train.eval_every=1000000000 train.eval_every_steps=0 train.progress=false dist.backend=torch \
    out_dir=/tmp/bound2/$name name=run > /tmp/bound2/$name.log 2>&1
  echo "$name rc=$? $(date +%T) $(ls -d /tmp/bound2/$name/run/*/ 2>/dev/null)"
}
bench() {  # name recipe profile intervals steps warmup only
  local name=$1 recipe=$2 prof=$3 every=$4 steps=$5 warm=$6 only=${7:-flow+rows}
  python tools/bench.py $recipe kfac.profile_steps=2 --cluster --nodes 2 --nproc 1 --rate 1gbit --intervals $every \
    --steps $steps --warmup $warm --reps 1 --only $only --no-outside-clock --profile $prof --out /tmp/bound2/bench_$name \
    > /tmp/bound2/bench_$name.log 2>&1
  echo "bench $name rc=$? $(date +%T)"
}
R18="recipes/resnet18_synthetic.yaml"; P18=docs/results/resnet18_2x1gbit/profile.yaml
R50="recipes/resnet50_spd.yaml data.image_size=32"; P50=docs/results/resnet50_2x1gbit/profile.yaml
trace r18_1_10_inv $R18 $P18 1 10 41 21 3 10
trace r18_1_10_between $R18 $P18 1 10 29 22 8 1
bench r18_1_10 $R18 $P18 1/10 30 10
trace r18_10_100_inv $R18 $P18 10 100 101 101 1 1
trace r18_10_100_between $R18 $P18 10 100 181 111 8 10
bench r18_10_100 $R18 $P18 10/100 100 100
trace r50_1_10_inv "$R50" $P50 1 10 41 21 3 10
trace r50_1_10_between "$R50" $P50 1 10 29 22 8 1
bench r50_1_10 "$R50" $P50 1/10 30 10
trace r50_10_100_inv "$R50" $P50 10 100 101 101 1 1
trace r50_10_100_between "$R50" $P50 10 100 181 111 8 10
bench r50_10_100 "$R50" $P50 10/100 100 100
bench r50_10_100_sgd "$R50" $P50 10/100 100 100 sgd
# Then, from the kept files:
# (cd /tmp/bound2 && python /work/main/tools/periods.py --every 10 *1_10*/run/*/ bench_*1_10/runs/*/run/*/ &&
#   python /work/main/tools/periods.py --every 100 bench_*10_100*/runs/*/run/*/) > docs/results/bound_windows_2x1gbit/periods.txt
# python tools/simulate.py docs/results/bound_windows_2x1gbit/traces/r50_1_10_inv.json docs/results/resnet50_2x1gbit/profile.yaml \
#   --workers 2 --variants flow --engine gloo --intervals 1/10 --between docs/results/bound_windows_2x1gbit/traces/r50_1_10_between.json
# (r18_*: docs/results/resnet18_2x1gbit/profile.yaml; 10_100: --intervals 10/100)
