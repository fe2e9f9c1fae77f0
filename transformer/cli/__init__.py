"""The command-line edge: the parts `train.py` and `evaluate.py` are made of. One error path (`errors`),
config checks that name the key at fault (`arguments`, `checks`), building components from the config
(`build`), sweeps (`sweeps`, `sweep_callbacks`), process-wide switches (`process`), the final metrics
(`results`), and evaluate.py's set-up and text streams (`evaluate_setup`, `text_io`).

With the entry points, the only place that imports Hydra / OmegaConf. It may import everything else
(`transformer.training`, `transformer.evaluation`, `data`); nothing but the entry points imports it.
"""
