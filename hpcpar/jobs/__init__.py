"""The jobs: generate, score and train on one skeleton, with the launcher, supervisor, watchdog,
fault injection, settings, plan, Slurm and the CLI on top of the models and the parallel core."""
