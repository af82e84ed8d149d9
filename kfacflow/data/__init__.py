"""Data sets: the built-in ones, users' own, the checks a data set must pass, and the sampler.

A factory of one's own (``data.name=module.path:factory``) returns ``(train_set, val_set, DataInfo(...))``.
"""

from kfacflow.data.checks import DataInfo

__all__ = ["DataInfo"]
