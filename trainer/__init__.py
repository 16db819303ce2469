"""What a worker runs: the model (models/), the global sample stream and the step loop."""
