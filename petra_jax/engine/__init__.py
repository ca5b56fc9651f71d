"""The PETRA engine: stages, schedules, methods, the pipeline and what it moves between devices."""
