"""The open lab: experiments declared before they run, a step graph with versioned outputs,
a journal that keeps everything, verdicts, and the published record."""

from moelab.lab.graph import Experiment, Prediction, Step, output_of, verdict, versioned

__all__ = ["Experiment", "Prediction", "Step", "output_of", "verdict", "versioned"]
