"""Training state: DCP checkpoints, their manifests and retention (ARCHITECTURE.md, "State")."""
