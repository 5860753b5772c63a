"""What a run reads: sources (files, folders, tables, `hf://` datasets), chats and preference pairs,
the token cache and its preparation, packing, which windows a step reads, and a GRPO run's prompts. Builds on
base, tokens and hub.
"""
