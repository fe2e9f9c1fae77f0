"""Our checkpoints and other formats, both ways: Hugging Face `transformers` (Marian, BERT) and CTranslate2.

Per format, one mapping holds both directions (`marian.py`: ours <-> MarianMTModel; `bert.py`: BERT-family
-> our classifier); each direction is its own module: export (`export_hf.py`, `ctranslate2.py`, checked on
load-back by `check.py`, with a model card, `card.py`) and import (`import_hf.py`, `import_bert.py`, the
weights checked first by `weights.py`). What both read and write: `source.py`. The CLIs: `export_cli.py`
(`aiayn-export CKPT --to hf|ctranslate2 --output DIR`), `import_cli.py` (`aiayn-import`), `lora_cli.py`
(`aiayn-lora`). Each export is proven to compute what the checkpoint computes (tests/unit/test_export.py);
settings a target cannot express are refused before anything is written. Needs the `export` extra
(transformers, ctranslate2, safetensors, sentencepiece).
"""
