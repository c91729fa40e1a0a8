"""The health monitor: detectors over rank telemetry and recorded clock ticks (RankLost, RankHung,
StragglerDetected, NonFiniteLoss, LossSpikeDetected)."""
