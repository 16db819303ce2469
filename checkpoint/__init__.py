"""Training state: DCP checkpoints, their manifests and retention (docs/architecture.md, "State")."""
