"""Whole training steps: recaccel's trainer parts against hand-written eager, reference and
compiled models; per-phase breakdown, timelines and reports."""

__all__: list[str] = []
