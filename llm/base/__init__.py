"""The ground every other wing stands on: errors and their exit codes, settings' ranges and fields, the
command line, atomic writes, the fit check and sizing, the device and the process group, and attention's
kernels (which modern_llm.py imports). Imports no other wing.
"""
