"""Suite-wide settings for trial processes (inherited by every rank, launcher and Ray worker)."""

import os

# A trial measures until its step-time interval is tight or measure.max_seconds (20 s) passes; on a
# loaded test machine most tiny test trials would run the full 20 s. Tests of the adaptive stop
# itself set their own limits.
os.environ.setdefault("TUNER_TEST_MEASURE_MAX_S", "1")
