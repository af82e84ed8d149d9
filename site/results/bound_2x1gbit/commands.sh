# The script as run for this sitting (2026-12-03, from /work/main with its dev venv; outputs under /tmp/bound,
# the files kept here copied from there: traces/NAME.json = NAME/run/*/layers.json, bench_*/ and r50_10_100_*/ = bench.json/txt).
# Traced steps of flow+rows (an inverting step and one between) at both intervals, on the emulated cluster.
cd /work/main
. /work/venv/bin/activate
trace() {  # name recipe profile F I steps step extra...
  local name=$1 recipe=$2 prof=$3 f=$4 i=$5 steps=$6 step=$7; shift 7
  python tools/cluster.py --nodes 2 --threads 1 -- run.py $recipe "$@" kfac.profile_steps=2 kfac.profile=$prof \
    kfac.variant=flow kfac.precondition=rows kfac.factor_update_freq=$f kfac.inv_update_freq=$i \
    train.steps=$steps train.timeline=$step train.save=false train.eval_every=1000000000 train.eval_every_steps=0 \
    train.progress=false dist.backend=torch out_dir=/tmp/bound/$name name=run > /tmp/bound/$name.log 2>&1
  echo "$name rc=$? $(ls -d /tmp/bound/$name/run/*/ 2>/dev/null)"
}
R18="recipes/resnet18_synthetic.yaml"; P18=docs/results/resnet18_2x1gbit/profile.yaml
R50="recipes/resnet50_spd.yaml data.image_size=32"; P50=docs/results/resnet50_2x1gbit/profile.yaml
trace r18_1_10_inv $R18 $P18 1 10 21 21
trace r18_1_10_between $R18 $P18 1 10 22 22
trace r18_10_100_inv $R18 $P18 10 100 101 101
trace r18_10_100_between $R18 $P18 10 100 111 111
trace r50_1_10_inv "$R50" $P50 1 10 21 21
trace r50_1_10_between "$R50" $P50 1 10 22 22
trace r50_10_100_inv "$R50" $P50 10 100 101 101
trace r50_10_100_between "$R50" $P50 10 100 111 111
bench() {  # name recipe profile intervals steps warmup
  local name=$1 recipe=$2 prof=$3 every=$4 steps=$5 warm=$6
  python tools/bench.py $recipe kfac.profile_steps=2 --cluster --nodes 2 --nproc 1 --rate 1gbit --intervals $every \
    --steps $steps --warmup $warm --reps 1 --only flow+rows --no-outside-clock --profile $prof --out /tmp/bound/bench_$name \
    > /tmp/bound/bench_$name.log 2>&1
  echo "bench $name rc=$?"
}
bench r18_10_100 $R18 $P18 10/100 100 100
bench r50_1_10 "$R50" $P50 1/10 20 10
bench r50_10_100 "$R50" $P50 10/100 100 100
bench r18_1_10 $R18 $P18 1/10 20 10
# Then, in the same sitting: ResNet-50 at 10/100, SGD and flow+rows again (r50_10_100_*):
# python tools/bench.py recipes/resnet50_spd.yaml data.image_size=32 kfac.profile_steps=2 --cluster --nodes 2 --nproc 1 \
#   --rate 1gbit --intervals 10/100 --steps 100 --warmup 100 --reps 1 --only sgd --no-outside-clock \
#   --profile docs/results/resnet50_2x1gbit/profile.yaml --out DIR          (sgd_1, flow+rows for flow_2, sgd_2)
# The bounds:
# python tools/simulate.py docs/results/bound_2x1gbit/traces/r18_1_10_inv.json docs/results/resnet18_2x1gbit/profile.yaml \
#   --workers 2 --variants flow --engine gloo --intervals 1/10 --between docs/results/bound_2x1gbit/traces/r18_1_10_between.json
