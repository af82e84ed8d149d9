"""The step as data: the plan, its routes, the schedule of factor and inverse updates."""
