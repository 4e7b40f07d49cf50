"""
How much a second Python thread that holds the GIL part of the time slows Engine.generate (the situation of the
server's engine thread beside its HTTP loop thread): one prompt, greedy, torch at 1 thread, 15 generates per
setting, three times alternating an idle thread and one running json.dumps ~30% of the time. Prints each median.

    NANOTRAIN_BASE_DIR=/tmp/ntrecipe python dev/bench_gil_contention.py rl cpu
"""
import json
import statistics
import sys
import threading
import time

import torch

from nanotrain.checkpoint import load_model
from nanotrain.engine import Engine

DUTY = 0.3  # the share of time the second thread holds the GIL (runs Python)


def main():
    torch.set_num_threads(1)
    model, tok, _, _ = load_model(sys.argv[1], sys.argv[2], -1, torch.device("cpu"))
    engine = Engine(model, tok)
    ids = tok.render_for_completion({"messages": [{"role": "user", "content": "What is 17 + 25?"}]})
    busy, stop = threading.Event(), threading.Event()

    def python_work():  # bursts of json.dumps (an event loop sending chunks), 0.3 ms of sleep between them
        chunk = {"id": "x" * 40, "choices": [{"delta": {"content": "abc"}, "index": 0}]}
        while not stop.is_set():
            if not busy.is_set():
                time.sleep(0.01)
                continue
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.0003 * DUTY / (1 - DUTY):
                json.dumps(chunk)
            time.sleep(0.0003)
    threading.Thread(target=python_work, daemon=True).start()
    for _ in range(3):
        for on in (False, True):
            busy.set() if on else busy.clear()
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                engine.generate([ids], 64, tool=True)
                times.append(time.perf_counter() - t0)
            print(f"second thread {'busy ' + str(DUTY) if on else 'idle'}: {1000 * statistics.median(times):.1f} ms")
    stop.set()


if __name__ == "__main__":
    main()
