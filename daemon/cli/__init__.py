"""Entry points: ultrad (the agent), ultrad local (a whole cluster on one machine), ultractl."""
