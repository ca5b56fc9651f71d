"""One stage: its module and state, its jitted steps, the checks of a model and of its inputs."""
