"""Evaluation: CORE and its bundle, the gold-answer bpb, the chat metrics (ChatCORE), lm-evaluation-harness on the export, per-sample logs and their comparison."""
