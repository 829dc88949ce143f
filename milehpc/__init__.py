"""milehpc: RL post-training of LLMs on HPC clusters, with Slurm + MPI as the control plane."""

__version__ = "0.1.0"
