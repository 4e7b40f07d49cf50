"""
The automatic device batch size, a wing of its own that the training loops call into and a newcomer can skip:
search.py (the search and the discovery), cache.py (the cache on disk), probe.py (a step's memory), stepdown.py (the
out-of-memory step-down during training), builders.py (the probes' models).
"""
