"""Job configuration, layouts and the planner (pure), and the techniques that apply a layout."""
