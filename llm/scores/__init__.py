"""Scores: benchmark tasks as lm-eval defines them, their log-likelihoods and written answers through the
engine, lm-eval's own tasks in-process, the one validation loop, and GRPO's reward functions. Builds on the
wings before it."""
