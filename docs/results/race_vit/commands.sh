#!/bin/bash
# The ViT race (one sitting, machine alone, after the char LM's). The second command reads every run the first
# left and trains only the rate 0.01 added to both Muon rows (and its seeds). Later the same day, the machine
# alone, at the same commit (afeca9d): the third and fourth widen every sweep whose best sat at its edge
# (AdamW 0.0005, both Muon rows 0.005, then 0.0025), reusing every run before them.
cd "$(git rev-parse --show-toplevel)"
VIT=(recipes/fashion_vit.yaml --optimizers adamw,muon,recipe --epochs 4 --seeds 0,1,2 --eval-every 117
  --targets 0.87,0.88,0.89 --grid "adamw=optim.lr:0.001,0.003" --out runs/race_vit train.save=false)
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.02,0.05" --grid "recipe=optim.lr:0.02,0.05"
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.01,0.02,0.05" --grid "recipe=optim.lr:0.01,0.02,0.05"
VIT[12]="adamw=optim.lr:0.0005,0.001,0.003"
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.005,0.01,0.02,0.05" --grid "recipe=optim.lr:0.005,0.01,0.02,0.05"
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.0025,0.005,0.01,0.02,0.05" \
  --grid "recipe=optim.lr:0.0025,0.005,0.01,0.02,0.05"
