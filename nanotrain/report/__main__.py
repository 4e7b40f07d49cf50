"""python -m nanotrain.report: the report card (nanotrain.report.card.main)."""

from nanotrain.common import run_script
from nanotrain.report.card import main

if __name__ == "__main__":
    run_script(main)
