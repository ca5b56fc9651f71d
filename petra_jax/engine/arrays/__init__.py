"""Array formats the engine moves and keeps: packed pytrees, quantised payloads, compute precision."""
