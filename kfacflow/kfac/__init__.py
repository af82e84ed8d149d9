"""Distributed K-FAC: the stages (factor, communicate, invert, precondition) and their orchestrator.

The stage modules register their entries when :func:`kfacflow.running.build.load_plugins` imports them.
"""
