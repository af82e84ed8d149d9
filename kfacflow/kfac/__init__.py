"""Distributed K-FAC: the four stages (factor, communicate, invert, precondition) and their orchestrator."""

from __future__ import annotations

from kfacflow.kfac import factors, fusion, inverse, placement, precondition, variants  # noqa: F401
