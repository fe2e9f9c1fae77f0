"""The command-line edge: the parts `train.py` and `evaluate.py` are made of. One error path (`errors`),
config checks that name the key at fault (`arguments`, `checks`), building components from the config
(`build`), sweeps (`sweeps`, `sweep_callbacks`) and process-wide switches (`process`).

With the entry points, the only place that imports Hydra / OmegaConf. It may import everything else
(`transformer.training`, `transformer.evaluation`, `data`); nothing but the entry points imports it.
"""
