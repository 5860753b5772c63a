"""What a run or an evaluation tells a reader: the monitor and metrics.jsonl, the model card every
export carries, and the report card with its chart. Builds on the wings before it.
"""
