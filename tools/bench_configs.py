"""The configurations each ablation of ``tools/bench.py`` compares: a name and the recipe overrides that make it.

A configuration whose first item is a script (:data:`LOOP`) runs that script instead of ``run.py``.
"""

from __future__ import annotations

LOOP = "tools/bench_loop.py"
FLOW_KFAC = ["kfac.variant=flow", "kfac.precondition=kfac"]
"""flow preconditioning every layer from its gradient (before ``rows`` became flow's own choice)."""
CONFIGS: dict[str, dict[str, list[str]]] = {
    "variants": {
        "sgd": ["kfac.variant=sgd"],
        "muon": ["kfac.variant=sgd", "optim.name=muon", "optim.lr=0.02"],
        "D-KFAC": ["kfac.variant=d"],
        "MPD-KFAC": ["kfac.variant=mpd"],
        "SPD-KFAC": ["kfac.variant=spd"],
        "flow": [*FLOW_KFAC],
        "flow+rows": ["kfac.variant=flow", "kfac.precondition=rows"],
    },
    "table4": {
        "-Pipe-LBP": ["kfac.variant=d"],
        "+Pipe-LBP": ["kfac.variant=d", "kfac.fusion=optimal"],
        "-Pipe+LBP": ["kfac.variant=d", "kfac.placement=lbp"],
        "+Pipe+LBP": ["kfac.variant=spd"],
    },
    "flow": {
        "SPD-KFAC": ["kfac.variant=spd"],
        "+arrival": ["kfac.variant=spd", "kfac.pipeline=arrival"],
        "+deferred": ["kfac.variant=spd", "kfac.pipeline=arrival", "kfac.grad_sync=deferred"],
        "+link": ["kfac.variant=spd", "kfac.pipeline=arrival", "kfac.grad_sync=deferred", "kfac.placement=link"],
        "+factor": [*FLOW_KFAC, "kfac.fusion=optimal", "kfac.placement=link", "kfac.broadcast=packed"],
        "+keeps": [*FLOW_KFAC, "kfac.fusion=optimal", "kfac.placement=link", "kfac.broadcast=owner_keeps"],
        "+full": [*FLOW_KFAC, "kfac.fusion=optimal", "kfac.placement=link", "kfac.broadcast=full"],
        "+update": [*FLOW_KFAC, "kfac.fusion=optimal", "kfac.broadcast=update", "kfac.factor_sync=allreduce"],
        "+fused": [*FLOW_KFAC, "kfac.fusion=optimal", "kfac.factor_sync=allreduce"],
        "+split": [*FLOW_KFAC, "kfac.factor_sync=allreduce"],
        "+owner": [*FLOW_KFAC],
        "layerwise": [*FLOW_KFAC, "kfac.fusion=layerwise"],
        "+rows": ["kfac.variant=flow"],  # flow as it is: layers preconditioned from their rows where that pays
    },
    "rare": {  # inverting rarely (--intervals 10/100): what the steps between inversions are worth sending
        "sgd": ["kfac.variant=sgd"],
        "muon": ["kfac.variant=sgd", "optim.name=muon", "optim.lr=0.02"],
        "flow+rows": ["kfac.variant=flow", "kfac.precondition=rows"],
        "+overlap": ["kfac.variant=flow", "kfac.precondition=rows", "kfac.grad_sync=overlap"],
        "+packed": ["kfac.variant=flow", "kfac.precondition=rows", "kfac.grad_sync=overlap", "kfac.broadcast=packed"],
    },
    "libraries": {  # kfac-pytorch in a user's loop, beside kfacflow in run.py and in the same loop
        "sgd": ["kfac.variant=sgd"],
        "flow+rows": ["kfac.variant=flow", "kfac.precondition=rows"],
        "loop sgd": [LOOP, "--library=sgd", "kfac.variant=sgd"],
        "loop flow+rows": [LOOP, "--library=kfacflow", "kfac.variant=flow", "kfac.precondition=rows"],
        "kfac-pytorch": [LOOP, "--library=kfac-pytorch", "--strategy=comm-opt", "--method=eigen"],
        "kfac-pytorch inverse": [LOOP, "--library=kfac-pytorch", "--strategy=comm-opt", "--method=inverse"],
        "kfac-pytorch mem-opt": [LOOP, "--library=kfac-pytorch", "--strategy=mem-opt", "--method=inverse"],
        "kfac-pytorch mem-opt sym": [
            LOOP,
            "--library=kfac-pytorch",
            "--strategy=mem-opt",
            "--method=inverse",
            "--symmetry-aware",
        ],
    },
    "exchange": {  # factors summed over ranks at every factor update, or only at the steps that invert
        "sgd": ["kfac.variant=sgd"],
        "flow+rows": [  # the gradients as before either: behind the factors (owner)
            "kfac.variant=flow",
            "kfac.precondition=rows",
            "kfac.factor_exchange=update",
            "kfac.grad_sync=owner",
        ],
        "+exchange": [
            "kfac.variant=flow",
            "kfac.precondition=rows",
            "kfac.factor_exchange=inversion",
            "kfac.grad_sync=owner",
        ],
        "+overlap": [  # with nothing else on the link between inversions, gradients averaged during backward
            "kfac.variant=flow",
            "kfac.precondition=rows",
            "kfac.factor_exchange=inversion",
            "kfac.grad_sync=overlap",
        ],
        "+between": [  # ... only on the steps that exchange no factors; on those that do, behind the factors
            "kfac.variant=flow",
            "kfac.precondition=rows",
            "kfac.factor_exchange=inversion",
            "kfac.grad_sync=between",
        ],
        "kfac-pytorch mem-opt": [LOOP, "--library=kfac-pytorch", "--strategy=mem-opt", "--method=inverse"],
    },
    "measured": {  # whole layers placed by their estimated preconditioning, or again after timing it
        "flow+rows": ["kfac.variant=flow", "kfac.precondition=rows"],
        "+measured": ["kfac.variant=flow", "kfac.precondition=rows", "kfac.placement_steps=5"],
    },
    "kinds": {  # what each kind of layer K-FAC takes (kfac.kinds) adds to the step of the recipe's own optimizer
        "optimizer": ["kfac.variant=sgd"],
        "linear": ["kfac.variant=flow", "kfac.kinds=[linear]"],
        "+conv2d": ["kfac.variant=flow", "kfac.kinds=[linear,conv2d]"],
        "+norm": ["kfac.variant=flow", "kfac.kinds=[linear,conv2d,norm]"],
    },
    "owners": {  # which worker runs each matrix's Newton-Schulz: all of them (torch.optim.Muon), or one each
        "muon replicated": ["kfac.variant=sgd", "optim.name=muon", "optim.muon.owners=replicated"],
        "muon round_robin": ["kfac.variant=sgd", "optim.name=muon", "optim.muon.owners=round_robin"],
        "muon placed": ["kfac.variant=sgd", "optim.name=muon", "optim.muon.owners=placed"],
        "muon auto": ["kfac.variant=sgd", "optim.name=muon", "optim.muon.owners=auto"],
        "kfac+muon replicated": ["kfac.variant=flow", "optim.name=muon", "optim.muon.owners=replicated"],
        "kfac+muon placed": ["kfac.variant=flow", "optim.name=muon", "optim.muon.owners=placed"],
        "kfac+muon kfac": ["kfac.variant=flow", "optim.name=muon", "optim.muon.owners=kfac"],
        "kfac+muon kfac overlap": [
            "kfac.variant=flow",
            "optim.name=muon",
            "optim.muon.owners=kfac",
            "kfac.grad_sync=overlap",
        ],
        "kfac+muon auto": ["kfac.variant=flow", "optim.name=muon", "optim.muon.owners=auto"],
        "kfac+muon overlap": [
            "kfac.variant=flow",
            "optim.name=muon",
            "optim.muon.owners=replicated",
            "kfac.grad_sync=overlap",
        ],
    },
    "fig10": {
        "Naive": ["kfac.variant=spd", "kfac.fusion=naive"],
        "LW w/o TF": ["kfac.variant=spd", "kfac.fusion=layerwise"],
        "LW w/ TTF": ["kfac.variant=spd", "kfac.fusion=threshold"],
        "SP w/ OTF": ["kfac.variant=spd", "kfac.fusion=optimal"],
    },
}
