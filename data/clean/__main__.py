"""`python -m data.clean SRC TGT --output-dir DIR [--config YAML]`: see `data.clean.cli`."""

from data.clean.cli import main

main()
