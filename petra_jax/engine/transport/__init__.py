"""Between stages: device placement, transfers, routed messages and the pipeline's state."""
