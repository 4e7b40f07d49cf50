"""
SIGINT and SIGTERM as a request to stop, for the training scripts: the first one sets `requested`, the training loop
finishes its step, saves a checkpoint and exits 0. A second SIGINT ends the script at once with one line and exit
status 130 (nanotrain.interrupt.interrupted: KeyboardInterrupt once main() runs, which nanotrain.common.run_script
reports; during the start-up, a line and os._exit).

Importing this module installs the handlers. It imports nothing but the standard library (and nanotrain.interrupt, which
imports only that), so a training script that
imports it first (before torch, which is slow to import) treats a signal during its start-up as a request
too, instead of dying with the signal before anything is saved; the loop then stops after its first step.
"""

import signal

from nanotrain.interrupt import interrupted

requested = False  # set by the first SIGINT/SIGTERM


def _handle(signum, frame):
    global requested
    if requested and signum == signal.SIGINT:
        interrupted("interrupted by a second Ctrl-C during the start-up; nothing was written")
    requested = True
    print(f"\nreceived signal {signum}: saving a checkpoint after this step, then exiting", flush=True)


signal.signal(signal.SIGINT, _handle)
signal.signal(signal.SIGTERM, _handle)
