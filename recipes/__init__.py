"""Recipes: commands that drive several stages as a whole, on the floor above them.

The stages (`extract/`, `train/`, `shards/`, `common/`) never import this package; a recipe runs
the stages' own commands or calls their library functions. Each module's docstring is its reference:

    runner.py           the one step runner of every recipe: the ledger (stages.json), skip/resume/redo
    step_check.py       every planned step's command line read by its stage's parser before any step runs
    experiment.py       a recipe's command line: [CONFIG] key=value, CONFIG's table and the experiment's file
    drafter/            `make drafter`: your own target to a checked, exported drafter (drafter/__init__.py)
    demo.py             `make demo`: the drafter command's plan and runner on a built-in target
    demo_smollm2.py     the real target's plan, scales and summary for the demo
    tiny/               `python -m recipes.tiny`: the tiny default target and its corpus
    smollm2/            `python -m recipes.smollm2`: the real target SmolLM2-135M-Instruct and its prompts
    compare_tiers.py    `make tiers`: storage tiers compared on τ, bytes and speed
    data_ladder.py      τ against the amount of training data
"""
