#!/bin/bash
# The ViT race (one sitting, machine alone, after the char LM's). The second command reads every run the first
# left and trains only the rate 0.01 added to both Muon rows (and its seeds); the third prints the table.
cd "$(git rev-parse --show-toplevel)"
VIT=(recipes/fashion_vit.yaml --optimizers adamw,muon,recipe --epochs 4 --seeds 0,1,2 --eval-every 117
  --targets 0.87,0.88,0.89 --grid "adamw=optim.lr:0.001,0.003" --out runs/race_vit train.save=false)
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.02,0.05" --grid "recipe=optim.lr:0.02,0.05"
python tools/tta.py "${VIT[@]}" --grid "muon=optim.lr:0.01,0.02,0.05" --grid "recipe=optim.lr:0.01,0.02,0.05"
