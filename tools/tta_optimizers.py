"""The optimizers ``tools/tta.py`` races, each made out of the recipe by overrides, and each one's default sweep."""

from __future__ import annotations

FIRST_ORDER = ("sgd", "adamw", "muon")
ONE_TEN = ["kfac.factor_update_freq=1", "kfac.inv_update_freq=10"]
TEN_HUNDRED = ["kfac.factor_update_freq=10", "kfac.inv_update_freq=100"]
OPTIMIZERS = {
    "sgd": ["kfac.variant=sgd", "optim.name=sgd"],
    "adamw": ["kfac.variant=sgd", "optim.name=adamw"],
    "muon": ["kfac.variant=sgd", "optim.name=muon"],
    "flow": ["optim.name=sgd", "kfac.variant=flow", *ONE_TEN],
    "flow_reduce": ["optim.name=sgd", "kfac.variant=flow", "kfac.factor=reduce", *ONE_TEN],
    "flow_staggered": ["optim.name=sgd", "kfac.variant=flow", "kfac.inverse_schedule=staggered", *ONE_TEN],
    "flow_16": ["optim.name=sgd", "kfac.variant=flow", "kfac.factor_examples=16", *ONE_TEN],
    "flow_8": ["optim.name=sgd", "kfac.variant=flow", "kfac.factor_examples=8", *ONE_TEN],
    "flow_10_100": ["optim.name=sgd", "kfac.variant=flow", *TEN_HUNDRED],
    "flow_10_100_16": ["optim.name=sgd", "kfac.variant=flow", "kfac.factor_examples=16", *TEN_HUNDRED],
    "spd": ["optim.name=sgd", "kfac.variant=spd", *ONE_TEN],
    "flow_muon": ["kfac.variant=flow", *TEN_HUNDRED, "optim.name=muon"],
    "flow_rms": ["optim.name=sgd", "kfac.variant=flow", *TEN_HUNDRED, "kfac.normalize=rms"],
    "recipe": [],
    "recipe_norm": ["kfac.kinds=[linear,conv2d,norm]"],
    "recipe_tied": ["kfac.kinds=[linear,conv2d,tied]"],
}
"""What makes each optimizer of the comparison out of the recipe: K-FAC with factors every step and inverses
every 10 (kfac-pytorch's CIFAR-10 defaults), or ``flow_10_100``: every 10 and 100 (its ImageNet defaults);
``flow_16`` and ``flow_8`` estimate the factors from 16 or 8 examples of each worker's batch
(``kfac.factor_examples``), ``flow_10_100_16`` from 16 at the ImageNet intervals; ``muon``: Muon for matrices
and filters, AdamW for the rest (``optim.name=muon``), ``flow_muon`` the same over K-FAC's preconditioned
gradients (every other K-FAC one takes SGD's step, whatever the recipe's optimizer); ``flow_rms``: each layer's
preconditioned update at RMS 1 (``kfac.normalize=rms``); ``recipe``: the recipe as it is (its own K-FAC
settings), ``recipe_norm`` the same with the norms' scale and shift preconditioned too (``kfac.kinds``),
``recipe_tied`` with a tied LM head's weight preconditioned too."""
GRIDS = {
    "sgd": "optim.lr:0.05,0.1,0.2",
    "adamw": "optim.lr:0.001,0.003",
    "muon": "optim.lr:0.01,0.02,0.05;optim.muon.momentum:0.9,0.95",
    **{name: "optim.lr:0.1;kfac.damping:0.03,0.1" for name in OPTIMIZERS if name not in FIRST_ORDER},
    "flow_muon": "optim.lr:0.02,0.05;kfac.damping:0.1",
    "flow_rms": "optim.lr:0.001,0.003,0.01;kfac.damping:0.1",
    "recipe": "",
    "recipe_norm": "",
    "recipe_tied": "",
}
"""The default sweeps: the rates each optimizer is usually run at on small image models (every K-FAC one alike;
Muon's: the speedruns' 0.02-0.05 and its momentum at 0.9 and 0.95); ``recipe``: none."""
