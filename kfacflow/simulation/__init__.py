"""The simulator: a K-FAC step as events from a traced step and a profile; the profile measured on the job; ``auto``."""
