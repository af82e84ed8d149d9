#!/bin/bash
# One seed, one after another: the char LM recipe for one epoch (219 steps), variant by variant.
cd "$(git rev-parse --show-toplevel)"

run() { name=$1; shift; /usr/bin/time -f "$name wall %e s" python run.py recipes/charlm_gpt.yaml train.save=false out_dir=runs/charlm_first_look/$name "$@" > runs/charlm_first_look/$name.log 2>&1; tail -1 runs/charlm_first_look/$name.log; grep "after .* steps" runs/charlm_first_look/$name.log | tail -1; }
mkdir -p runs/charlm_first_look
run adamw kfac.variant=sgd
run flow_expand
run flow_reduce kfac.factor=reduce
run adamw_untied kfac.variant=sgd model.kwargs.tie=false
run flow_reduce_emb_untied kfac.factor=reduce model.kwargs.tie=false 'kfac.kinds=[linear,embedding]'
