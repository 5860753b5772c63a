"""The training run: what it starts from (startup's Plan), how its step runs (the Runner, decided
once), its clock and evaluation policy (schedule), resume, the weight average, fine-tuning's automatic rates,
and the objectives (preference tuning and GRPO with its rollouts). Builds on every wing before it; the trainer
script sits on top.
"""
