"""The strategies that act a step out (pipeline, broadcasts, gradient and factor sync, exchange)."""
