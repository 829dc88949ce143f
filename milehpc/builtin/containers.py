"""Built-in container runtimes."""

from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import ContainerRuntime


@hookimpl
def milehpc_container_runtimes():
    yield ContainerRuntime(
        name="apptainer",
        impl="milehpc.render.container:apptainer_argv",
        description="apptainer exec --nv|--rocm --cleanenv with the site's binds and one for every path the job "
                    "reads or writes; SLURM/PMIx/rank variables forwarded",
    )
