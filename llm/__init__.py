"""The modules the scripts at the repository root import, in nine wings, each a folder named for what it does,
listed in the order the imports flow: base, tokens, hub, data, formats, generate, scores, reports, train. A
module imports only the wings before its own (tests/test_layout.py holds the order).

The files a user runs or edits stay at the root (config.py, modern_llm.py, muon_optimizer.py and the scripts);
this package imports from there only config, modern_llm and muon_optimizer. README's Files table says what
each wing holds, docs/architecture.md what each module owns."""
