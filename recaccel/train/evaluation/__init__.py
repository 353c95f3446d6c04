"""Evaluation: metrics of a model over a reader (evaluate), per-row predictions
(predictions) and evaluating one checkpoint of a run (from_checkpoint)."""

__all__ = ["evaluate", "from_checkpoint", "predictions"]
