"""A Hydra sweeper on Optuna >= 4 (ask-and-tell) with pruning and several objectives.

`hydra/sweeper=aiayn_optuna` reads the same `hydra.sweeper` YAML as hydra-optuna-sweeper (params in its
grammar, direction, n_trials, n_jobs, study_name, storage, sampler) and adds `pruner`. Hydra finds the
sweeper class in `optuna_sweeper` and the configs in `config` (it imports every module of `hydra_plugins`
whose name does not start with `_`, so those two import neither Optuna nor torch); the work is done in
`_space` (the params grammar -> Optuna distributions) and `_study` (the study and the ask-launch-tell
loop). docs/sweeps.md describes it for users.
"""
