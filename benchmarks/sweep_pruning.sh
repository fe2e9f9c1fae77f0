#!/bin/bash
# docs/sweeps.md "Measured": the same 16-trial Multi30k de->en TPE search without and with the MedianPruner,
# one after the other; prints each search's wall time. Run from the repository root:
#   MULTI30K_DIR=/path/to/multi30k nice -n 10 bash benchmarks/sweep_pruning.sh
# Totals afterwards: sum of `global_step` over logs/train/sweeps/m30k_*/*/metrics.json, and the studies'
# best values (optuna.load_study(..., storage="sqlite:///logs/train/sweeps/m30k_<name>/optuna.db")).
set -u
COMMON=(-m hparams_search=multi30k_optuna data.data_dir=$MULTI30K_DIR logger=csv test=false
  data.show_progress=false hydra.sweeper.n_trials=16 hydra.sweeper.sampler.n_startup_trials=5
  trainer.max_epochs=4 ++trainer.limit_train_batches=0.2 ++trainer.limit_val_batches=0.2
  ++trainer.enable_progress_bar=false callbacks.rich_progress_bar=null
  model.config.d_ff=512 'model.config.d_model=choice(128,256)' 'model.config.n_encoder_layers=choice(2,3)'
  'model.optimizer.lr=tag(log,interval(5e-4,5e-3))' 'model.scheduler.warmup_steps=int(interval(20,200))')
for name in nopruner median; do
  extra=()
  [ "$name" = median ] && extra=(hydra/sweeper/pruner=median hydra.sweeper.pruner.n_startup_trials=4)
  start=$(date +%s)
  python train.py "${COMMON[@]}" hydra.sweeper.study_name=m30k_$name "${extra[@]}" > m30k_$name.log 2>&1
  echo "$name: exit $?, wall $(( $(date +%s) - start )) s"
done
