"""The command-line edge: the parts `train.py` and `evaluate.py` are made of. One error path (`errors`),
config checks that name the key at fault (`arguments`, `checks`), building components from the config
(`build`), sweeps and their Hydra callbacks (`sweeps`), process-wide switches (`process`), what the start
prints (`console`), the final metrics (`results`), evaluate.py's steps (`evaluate_steps`: the set-up of a
run on saved checkpoints, which distillation's teachers share, then scoring and writing), its text streams
(`text_io`) and word alignments (`word_alignments`);
distillation and back-translation in their own package (`distill`), which only the entry points import.

With the entry points, the only place that imports Hydra / OmegaConf. It may import everything else
(`transformer.training`, `transformer.evaluation`, `data`); nothing but the entry points imports it.
"""
