"""Ship a trained translation checkpoint: Hugging Face `transformers` (Marian) and CTranslate2 directories.

`aiayn-export CKPT --to hf|ctranslate2 --output DIR` (`transformer.export.cli`). Each target is proven to
compute what the checkpoint computes (tests/unit/test_export.py); settings a target cannot express are
refused before anything is written. Needs the `export` extra (transformers, ctranslate2, safetensors).
"""
