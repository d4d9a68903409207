"""Training: the rStar-Math policy (SFT) and process preference model (PPM).

Training runs out of process: `python -m rstar_pipelines.training.run CONFIG.json` (see `run`), so
a Dagster asset launches it with Pipes and gets a checkpoint directory back. Importing this package
or its modules loads neither torch nor transformers; the functions that need them import them.
"""
