"""
The chat tasks, one class per file in nanochat's shape (tasks/*.py): the built-ins arith, spell, identity (generated
offline), the benchmarks arc_easy, arc_challenge, mmlu, gsm8k, humaneval, the training sources arc, mmlu_aux,
smoltalk, gsm8k, and the user's own jsonl / hf files. tasks/common.py holds the Task contract and what tasks share;
tasks/registry.py names them all and parses --tasks and the mixture spec.
"""
