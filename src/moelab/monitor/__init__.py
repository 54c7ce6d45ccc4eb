"""Watching a run: health checks against its own past, its forecast and the ladder; fault injection to test them."""
