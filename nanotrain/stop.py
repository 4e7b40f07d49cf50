"""
SIGINT and SIGTERM as a request to stop, for the training scripts: the first one sets `requested`, the training loop
finishes its step, saves a checkpoint and exits 0 (a second SIGINT raises KeyboardInterrupt at once).

Importing this module installs the handlers. It imports nothing but the standard library, so a training script that
imports it first (before torch, which is slow to import) treats a signal during its start-up as a request
too, instead of dying with the signal before anything is saved; the loop then stops after its first step.
"""

import signal

requested = False  # set by the first SIGINT/SIGTERM


def _handle(signum, frame):
    global requested
    if requested and signum == signal.SIGINT:
        raise KeyboardInterrupt
    requested = True
    print(f"\nreceived signal {signum}: saving a checkpoint after this step, then exiting", flush=True)


signal.signal(signal.SIGINT, _handle)
signal.signal(signal.SIGTERM, _handle)
