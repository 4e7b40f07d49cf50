"""The report card of a run (card.py) and its plots (plots.py); python -m nanotrain.report writes it."""
