"""Recipes: the typed schema of every key, its ranges and rules, reading recipe files and overrides."""
