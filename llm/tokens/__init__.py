"""Tokenizers: special tokens, the chat template and its loss masks, training a tokenizer, and the
tiktoken encoder preparation uses. Builds on base.
"""
