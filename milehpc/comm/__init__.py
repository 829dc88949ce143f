"""Inside the job, under everything that talks to another rank: the MPI world and its split into trainer and
rollout groups, the torch.distributed groups built on it (``world``), device binding (``devices``), the liveness
watchdog (``watchdog``), the addresses and ports ranks offer each other (``net``), and the context every
rank's entry and every engine/trainer factory receives (``context``)."""
