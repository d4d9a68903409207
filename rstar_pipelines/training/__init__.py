"""Training: the rStar-Math policy (SFT) and process preference model (PPM), GRPO-RoC on TRL, and
the SeerAttention-R gates.

Every job runs out of process under one launcher: `python -m rstar_pipelines.training.launch
CONFIG.json` (see `launch`) starts `accelerate launch` with the job's launch configuration, and
each process runs `run`; a Dagster asset launches it with Pipes and gets a checkpoint directory
back. Importing this package or its modules loads neither torch, transformers nor TRL; the
functions that need them import them.
"""
