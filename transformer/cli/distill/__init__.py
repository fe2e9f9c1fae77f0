"""Distillation and back-translation (docs/distillation.md): synthetic training pairs for `train.py`.

- `synthetic`: `distill.*` / `backtranslate.*` read and checked, the translations handed to `data.extra_train`
- `teachers`: the teachers (an ensemble) or the reverse model, checked against the student's data
- `corpus`: a corpus translated in resumable chunks into the cache, shared by DDP ranks

It builds on the rest of `transformer.cli` (the error path, the set-up of a run on saved checkpoints);
only the entry points import it.
"""
