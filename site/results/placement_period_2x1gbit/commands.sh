# A/B, one sitting (2026-12-03): /tmp/old is a worktree of the commit before (35a5dab, git worktree add /tmp/old 35a5dab),
# /work/main this commit (the placement that balances a period); runs alternate; outputs copied here (bench.json/txt).
. /work/venv/bin/activate
R18="recipes/resnet18_synthetic.yaml"; P18=docs/results/resnet18_2x1gbit/profile.yaml
R50="recipes/resnet50_spd.yaml data.image_size=32"; P50=docs/results/resnet50_2x1gbit/profile.yaml
bench() {  # tree tag recipe profile steps warmup
  local tree=$1 tag=$2 recipe=$3 prof=$4 steps=$5 warm=$6
  cd $tree
  python tools/bench.py $recipe kfac.profile_steps=2 --cluster --nodes 2 --nproc 1 --rate 1gbit --intervals 1/10 \
    --steps $steps --warmup $warm --reps 1 --only flow+rows --no-outside-clock --profile $prof --out /tmp/ab/$tag \
    > /tmp/ab/$tag.log 2>&1
  echo "$tag rc=$? $(date +%T)"
}
for rep in 1 2; do
  bench /tmp/old r18_old_$rep "$R18" $P18 30 10
  bench /work/main r18_new_$rep "$R18" $P18 30 10
done
for rep in 1 2; do
  bench /work/main r50_new_$rep "$R50" $P50 30 10
  bench /tmp/old r50_old_$rep "$R50" $P50 30 10
done
