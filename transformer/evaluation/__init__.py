"""Evaluation without Lightning: rebuild a trained network from a checkpoint (`restore`), score it on a
split (`scoring`: sacreBLEU, chrF, accuracy, F1, calibration), write the outputs and a Markdown report
(`reports`, `plots`), and tabulate a sweep (`sweep_report`).

Imports the torch-only core only; never `transformer.training`, `transformer.cli` or the entry
points, so a checkpoint is restored and scored with torch, sacreBLEU and torchmetrics alone.
"""
