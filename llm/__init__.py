"""The modules the scripts at the repository root import: data, generation, formats, the training loop's parts.

The files a user runs or edits stay at the root (config.py, modern_llm.py, muon_optimizer.py and the scripts);
this package imports from there only config and modern_llm. README's Files table says what each module owns.
"""
