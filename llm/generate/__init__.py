"""Generation: the next-token rule, the prefill and decode steps (compiled once per model), the
batched engine with continuous batching, a model made ready to generate, and the server's API and worker.
Builds on base, tokens and formats.
"""
