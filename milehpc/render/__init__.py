"""From a validated job, site and plan to the job script (Jinja2 templates in ``sbatch/``, the Apptainer wrap)
and the run directory."""
