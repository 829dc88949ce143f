"""Talking to the scheduler from the login node: Slurm (sbatch, squeue/sacct/scontrol, scancel, logs), the
local launcher, sweeps as job arrays, and the user's job records."""
