"""Plan → ordinary upstream files: accelerate.yaml, deepspeed.json, launch.sh, sbatch."""
