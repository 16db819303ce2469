"""What a worker runs: the Llama model, the global sample stream and the step loop."""
