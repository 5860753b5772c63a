"""Model files, each with one reader and one writer: Hugging Face folders and families, GGUF, LoRA adapters,
checkpoints and `trainer_state.pt`, `hf:` models from the Hub, and loading any of them by kind. Builds on
base, tokens and hub."""
