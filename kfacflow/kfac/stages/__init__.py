"""The stages of a K-FAC step (factor, communicate, invert, precondition): contracts and entries."""
