"""The scaling ladder: rungs, fits, laws, forecasts with bands, backtests and re-planning."""

# the laws a forecast can be made by (moelab.ladder.law, moelab.ladder.forecast); here so that the
# command line can name them without importing the fitting code
LAWS = ("multi-power", "lr-annealing", "chinchilla", "multi-power-peak", "lr-annealing-peak")
DEFAULT_LAW = "lr-annealing"
LAW_CHOICES = (*LAWS, "per-fraction")
