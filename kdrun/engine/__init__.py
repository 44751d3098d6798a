"""Engine: the objective (stages of weighted loss terms), the stage loop with its one training step
for every device and precision, optimizers, loss balancing, checkpoints and the teacher-output store."""
