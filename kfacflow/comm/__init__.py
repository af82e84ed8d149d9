"""Communication backends behind one small interface (:class:`kfacflow.comm.base.Backend`).

``torch_dist`` (gloo, NCCL; DDP for gradients) and ``horovod`` register themselves; Horovod
itself is imported only when a recipe chooses it.
"""
