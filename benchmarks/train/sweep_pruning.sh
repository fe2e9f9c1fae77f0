#!/bin/bash
# docs/sweeps.md "Measured": the same 16-trial Multi30k de->en TPE search without a pruner, with the
# MedianPruner and with the SuccessiveHalvingPruner, one after the other; prints each search's wall time.
# Each trial: 2 full epochs (492 optimizer steps of 2048 tokens), validated (greedy BLEU on a quarter of the
# validation set) every quarter epoch, so that a pruner can stop a trial from its second validation on
# (step 122 of 492). Run from the repository root:
#   MULTI30K_DIR=/path/to/multi30k nice -n 10 bash benchmarks/train/sweep_pruning.sh
# (SEARCHES="median halving": only those searches, then the seeds; SEEDS="": no seeds)
# The studies are new ones: remove logs/train/sweeps/m30k_* first (the same command would continue them).
# Totals afterwards: sum of `global_step` over logs/train/sweeps/m30k_*/*/metrics.json, and the studies'
# best values (optuna.load_study(..., storage="sqlite:///logs/train/sweeps/m30k_<name>/optuna.db")).
set -u
mkdir -p logs  # each search's and run's output: logs/m30k_<name>.log
COMMON=(-m hparams_search=multi30k_optuna data.data_dir=$MULTI30K_DIR logger=csv test=false
  data.show_progress=false hydra.sweeper.n_trials=16 hydra.sweeper.sampler.n_startup_trials=5
  trainer.max_epochs=2 ++trainer.val_check_interval=0.25 ++trainer.limit_val_batches=0.25
  ++trainer.enable_progress_bar=false callbacks.rich_progress_bar=null
  model.config.d_ff=512 'model.config.d_model=choice(64,128)' 'model.config.n_encoder_layers=choice(1,2)'
  'model.optimizer.lr=tag(log,interval(5e-4,5e-3))' 'model.scheduler.warmup_steps=int(interval(50,400))')
for name in ${SEARCHES-nopruner median halving}; do
  extra=()
  [ "$name" = median ] && extra=(hydra/sweeper/pruner=median hydra.sweeper.pruner.n_startup_trials=3
    hydra.sweeper.pruner.n_warmup_steps=100)
  # rungs at the second validation (step 122) and at step 366; a third of the trials go on at each
  [ "$name" = halving ] && extra=(hydra/sweeper/pruner=successive_halving
    hydra.sweeper.pruner.min_resource=120 hydra.sweeper.pruner.reduction_factor=3)
  start=$(date +%s)
  python train.py "${COMMON[@]}" hydra.sweeper.study_name=m30k_$name "${extra[@]}" > logs/m30k_$name.log 2>&1
  echo "$name: exit $?, wall $(( $(date +%s) - start )) s"
done
# Run-to-run noise: the unpruned search's best trial (11) trained again alone with seeds 42 (the search's:
# the same run again), 1 and 2; val/bleu_best in logs/train/runs/m30k_seed_<seed>/metrics.json
BEST=(model.config.d_model=64 model.config.n_encoder_layers=1 model.config.n_decoder_layers=1
  model.optimizer.lr=0.0044874659676602925 model.scheduler.warmup_steps=219
  model.config.dropout=0.052790651674463056 model.label_smoothing=0.18716018849674834)
for seed in ${SEEDS-42 1 2}; do
  python train.py experiment=multi30k_de_en data.data_dir=$MULTI30K_DIR logger=csv test=false \
    data.show_progress=false trainer.max_epochs=2 ++trainer.val_check_interval=0.25 \
    ++trainer.limit_val_batches=0.25 ++trainer.enable_progress_bar=false callbacks.rich_progress_bar=null \
    model.config.d_ff=512 "${BEST[@]}" seed=$seed hydra.run.dir=logs/train/runs/m30k_seed_$seed \
    > logs/m30k_seed_$seed.log 2>&1
  echo "seed $seed: exit $?"
done
