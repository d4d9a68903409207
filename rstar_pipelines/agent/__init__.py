"""rStar2-Agent's agentic RL (docs/agent.md) in plain Python: multi-turn rollouts that call a Python
tool in the sandbox, their binary rewards, Resample-on-Correct (`roc`) and the GRPO policy loss
(`grpo`). Nothing here knows Dagster; the training job and its stage build on these modules.

Importing the package loads nothing heavy: the modules import torch inside the functions that
need it.
"""
