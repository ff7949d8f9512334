"""`make drafter target=DIR prompts=FILE` (`python -m recipes.drafter`): from a model directory and a
prompt file to a checked, exported DFlash drafter, in one command (docs/own-target.md).

Modules, one job each: `config` (DrafterRecipeConfig, the command line), `prompts` (the training and
held-out prompt sets), `defaults` (defaults derived from the target and the machine, with reasons;
each scale's settings), `checks` (what a later step would refuse, and the target's self-check, checked
at step 1 before anything is written), `plan` (the steps as the stages' own command lines), `results`
(the numbers a summary quotes), `machine` (what the steps run on), `run` (`run_drafter(cfg) -> summary`,
the library entry point). The steps run through `recipes.runner`, every recipe's one step runner
(ledger, skip/resume, progress, side by side). The demos (`recipes.demo`) are this same plan and runner
applied to the built-in targets.
"""
