"""The scaling ladder: rungs, fits, laws, forecasts with bands, backtests and re-planning."""

# the laws a forecast can be made by (moelab.ladder.law, moelab.ladder.forecast); here so that the
# command line can name them without importing the fitting code
# (multi-power was removed in issue 37: it left out Luo et al.'s eta_k^-gamma factor, so it was not the
# paper's law; the lr-annealing law carries the schedule instead)
LAWS = ("lr-annealing", "chinchilla", "lr-annealing-peak")
DEFAULT_LAW = "lr-annealing"
# per fraction, two free parameters: the size exponent (prior-alpha) or E (prior-e) from the recipe's
# prior file (moelab.ladder.prior); prior: whichever of those and Marin's E = 1.5 forecasts the ladder's
# largest rung best from the smaller ones (forward chaining)
PRIOR_LAWS = ("prior", "prior-alpha", "prior-e")
LAW_CHOICES = (*LAWS, "per-fraction", *PRIOR_LAWS)
