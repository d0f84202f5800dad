"""The scoring job: log-probabilities of given token sequences under the model."""

from .data import ScoreData, load_score_data
from .engine import ScoreResult, run_scoring

__all__ = ["ScoreData", "ScoreResult", "load_score_data", "run_scoring"]
