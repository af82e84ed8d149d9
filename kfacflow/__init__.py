"""kfacflow: recipe-driven distributed training with K-FAC (D-KFAC, MPD-KFAC, SPD-KFAC)."""

__version__ = "0.1.0"
