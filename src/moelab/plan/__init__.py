"""The memory planner: what a config holds per device (memory), checked against XLA's compiled program (memory_check)."""
