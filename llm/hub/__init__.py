"""The checked Hugging Face Hub client that datasets (data) and models (formats) download through: what
the Hub sends is checked before it names a file. Builds on base.
"""
