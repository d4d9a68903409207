"""The declared pipeline: the loader of pipeline.yaml (`spec`), the stage base (`stage`), the
Dagster asset factory (`factory`), the item cache and the helpers every stage shares."""
