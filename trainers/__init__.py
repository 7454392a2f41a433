"""Training backends behind one interface (trainers.base.TrainerBackend), run as Ray actors."""
