"""This node's workers: the supervisor, the watchdog, the worker-facing service, the c10d store host."""
