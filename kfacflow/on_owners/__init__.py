"""Per-layer work done by a K-FAC layer's owner alone, beyond the preconditioning (``optim.muon.owners=kfac``).

Where owners precondition their layers and send the updates (``kfac.broadcast=update`` or
``fused_update``: ``kfac.variant=flow``), the first-order step's per-layer work can stay with the owner
too: :mod:`~kfacflow.on_owners.muon_step` runs Muon's momentum and Newton-Schulz of each owned layer
there and sends the finished direction in place of the update (the same bytes), so no rank repeats
another's orthogonalisation and no second exchange follows.
"""
