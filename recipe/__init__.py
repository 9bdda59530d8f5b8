"""What a training run needs around the model: the launch (GPUs, ranks, launchers), the logger, config checks,
checkpoints and preemption. train.py composes these; each module has one job."""
