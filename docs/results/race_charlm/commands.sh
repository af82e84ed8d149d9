#!/bin/bash
# The char LM race (one sitting, machine alone). The second command reads every run the first left and trains
# only what is new (a second Muon rate and K-FAC + Muon); the third prints the table at other loss targets
# without training anything. Then the norms on one seed, with each K-FAC step.
cd "$(git rev-parse --show-toplevel)"
LM=(recipes/charlm_gpt.yaml --epochs 1 --seeds 0,1,2 --eval-every 22
  --grid "adamw=optim.lr:0.001,0.003,0.006" --grid "recipe=optim.lr:0.003,0.006" --out runs/race_charlm train.save=false)
python tools/tta.py "${LM[@]}" --loss-targets 2.3,2.2,2.15,2.1 --grid "muon=optim.lr:0.01,0.02,0.05" \
  --optimizers adamw,muon,recipe
python tools/tta.py "${LM[@]}" --loss-targets 2.3,2.2,2.15,2.1 --grid "muon=optim.lr:0.01,0.02,0.05,0.1" \
  --optimizers adamw,muon,recipe,flow_muon --grid "flow_muon=optim.lr:0.05,0.1;kfac.damping:0.1"
python tools/tta.py "${LM[@]}" --loss-targets 2.154,1.9,1.8,1.7 --grid "muon=optim.lr:0.01,0.02,0.05,0.1" \
  --optimizers adamw,muon,recipe,flow_muon --grid "flow_muon=optim.lr:0.05,0.1;kfac.damping:0.1"
python tools/tta.py recipes/charlm_gpt.yaml --epochs 1 --seeds 0 --eval-every 22 --loss-targets 2.3,2.2,2.15,2.1 \
  --optimizers recipe_norm --grid "recipe_norm=optim.lr:0.006" --out runs/race_charlm_norm train.save=false
python tools/tta.py recipes/charlm_gpt.yaml --epochs 1 --seeds 0 --eval-every 22 --loss-targets 2.154,1.9,1.8,1.7 \
  --optimizers flow_muon --grid "flow_muon=optim.lr:0.1;kfac.damping:0.1" --out runs/race_charlm_norm_muon \
  'kfac.kinds=[linear,conv2d,norm]' train.save=false
# Later the same day, the machine alone: K-FAC + Muon's sweep widened past its edge (0.2), at the race's commit
# (afeca9d, reusing every run above); then, at c52428d, the tied head preconditioned against the recipe as it
# ships, 3 seeds each (tied/).
python tools/tta.py "${LM[@]}" --loss-targets 2.154,1.9,1.8,1.7 --grid "muon=optim.lr:0.01,0.02,0.05,0.1" \
  --optimizers adamw,muon,recipe,flow_muon --grid "flow_muon=optim.lr:0.05,0.1,0.2;kfac.damping:0.1"
python tools/tta.py recipes/charlm_gpt.yaml --epochs 1 --seeds 0,1,2 --eval-every 22 --loss-targets 2.154,1.9,1.8,1.7 \
  --optimizers recipe,recipe_tied --out runs/tied_charlm train.save=false
