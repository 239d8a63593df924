"""The run directory, the contract between the launcher and the ranks: names, files, checkpoints."""
