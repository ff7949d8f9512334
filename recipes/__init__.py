"""Recipes: commands that drive several stages as a whole, on the floor above them.

The stages (`extract/`, `train/`, `shards/`, `common/`) never import this package; a recipe runs
the stages' own commands or calls their library functions. Here live the built-in targets'
builders (`recipes.tiny`, `recipes.smollm2`), the demos (`recipes.demo`), the storage-tier
comparison (`recipes.compare_tiers`) and the data ladder (`recipes.data_ladder`).
"""
