"""
Ctrl-C (SIGINT) as one line and exit status 130 (the shell's code for SIGINT), never a traceback. A script imports
this module first, before torch (slow to import): from then on a Ctrl-C while the script starts up (imports, settings)
or ends (after its main(): atexit handlers, the process group's teardown) prints `error: interrupted (Ctrl-C)` to
stderr and ends the process at once. While nanotrain.common.run_script runs the script's main() (main_started), a
Ctrl-C raises KeyboardInterrupt as Python's own handler does, so the files being written are cleaned up on the way
out, and run_script prints the one line and exits 130. Python runs a signal's handler between bytecodes, so a Ctrl-C
waits for the C call in progress (a long tensor operation, a blocked collective), and two that come during the same
call count as one.

The training scripts import nanotrain.stop instead, which replaces this handler (its first SIGINT asks the run to
stop) and calls interrupted() for a second one. Standard library only.
"""

import os
import signal
import sys

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C
main_started = False  # True while nanotrain.common.run_script runs the script's main()


def interrupted(message="interrupted (Ctrl-C)"):
    """
    Ends the script for a Ctrl-C: raises KeyboardInterrupt while main() runs (run_script turns it into one line and
    exit code EXIT_CODE after the cleanup), else prints `error: {message}` to stderr and leaves with
    os._exit(EXIT_CODE) after flushing stdout (nothing is being written before main() runs or after it ends).
    """
    if main_started:
        raise KeyboardInterrupt
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed or broken stdout: the line on stderr still goes out
        pass
    print(f"\nerror: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def _handle(signum, frame):
    interrupted()


signal.signal(signal.SIGINT, _handle)
