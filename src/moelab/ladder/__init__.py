"""The scaling ladder: rungs, fits, forecasts, health checks, fault injection and re-planning."""
