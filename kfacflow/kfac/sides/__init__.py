"""The side blocks: what K-FAC preconditions beside its layers' pipelines, each by a factor of its own kind.

A norm's scale and shift by a diagonal (:mod:`~kfacflow.kfac.sides.norms`), a weight shared by an
embedding and a head (:mod:`~kfacflow.kfac.sides.tied`), cross-attention's projections by row blocks
(:mod:`~kfacflow.kfac.sides.cross_attention`), on the parts they share
(:mod:`~kfacflow.kfac.sides.factors`), called together (:mod:`~kfacflow.kfac.sides.blocks`).
"""
