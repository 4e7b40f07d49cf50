"""The sandbox for model-written code: process isolation and limits (execution), the batched sweep, the trusted HumanEval verdict."""
