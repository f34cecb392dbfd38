"""Auto-tuning of deep-learning training performance on real devices."""

__version__ = "0.1.0"
