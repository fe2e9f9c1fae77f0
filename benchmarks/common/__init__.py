"""What every benchmark group shares: the references compared against, shapes, timing, the machine's
description and results files."""
