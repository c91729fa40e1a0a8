"""Every concrete message type, in one tuple: the codec's union and the fixture tests read it from here."""

from flightdeck.events import (
    archive,
    checkpoint,
    clock,
    commands,
    findings,
    fleet,
    heartbeats,
    job,
    logs,
    plan,
    training,
)
from flightdeck.events.authors import RANK_TELEMETRY
from flightdeck.events.base import Event, RankEvent

ALL_TYPES: tuple[type[Event], ...] = (
    # job
    job.JobSubmitted, job.JobQueued, job.AllocationRequested, job.AllocationGranted,
    job.AllocationDenied, job.AllocationReleased, job.WorkersStarted, job.WorkersExited,
    job.JobResumed, job.JobPhaseChanged, job.JobPreempted, job.JobCompleted, job.JobFailed, job.CancelRequested,
    job.JobCancelled, job.RollbackAsked, job.CheckpointAdopted,
    # fleet
    fleet.NodeRegistered, fleet.NodeHeartbeat, fleet.SelfCheckPassed, fleet.SelfCheckFailed,
    fleet.NodeCordoned, fleet.NodeUncordoned, fleet.NodeLost,
    fleet.AgentAlive,  # on telemetry: an idle agent's sign of life
    # training telemetry
    training.StepCompleted, training.Heartbeat, training.RankFault, training.FaultInjected,
    training.RolledBack, training.RankStarted, training.SpikeReplayed, training.SnapshotsOff, training.ModelRegistered,
    heartbeats.RankHeartbeats,  # a node's ranks' heartbeats, batched by its agent
    logs.RankOutput,  # what a rank printed, shipped by its agent
    # checkpoint
    checkpoint.CheckpointStaged, checkpoint.ShardsUploaded, checkpoint.CheckpointCommitted, checkpoint.CheckpointFailed,
    checkpoint.CheckpointPending,
    checkpoint.CheckpointDeleted,
    checkpoint.CheckpointRejected, checkpoint.CheckpointRefused, checkpoint.CheckpointScrubbed,
    checkpoint.CheckpointsFailing, checkpoint.CheckpointsRecovered, checkpoint.FinalStateUnsaved,
    checkpoint.FinalStateSaved,
    # health findings
    findings.RankLost, findings.RankHung, findings.StragglerDetected, findings.NonFiniteLoss,
    findings.LossSpikeDetected, findings.SpikeDiagnosed, findings.InexactRestore, findings.LossOutlier,
    # plan
    plan.ReshardPlanned,
    # the archive of a job's telemetry and output
    archive.HistoryArchived,
    # commands
    commands.CheckpointRequested, commands.RollbackRequested, commands.StopRequested,
    commands.PauseRequested, commands.ResumeRequested,
    # clock and shell records
    clock.ClockTick, clock.CoreConfigured, clock.DeadLettered,
)

BY_NAME: dict[str, type[Event]] = {t.__name__: t for t in ALL_TYPES}
COMMAND_TYPES: tuple[type[Event], ...] = (
    commands.CheckpointRequested, commands.RollbackRequested, commands.StopRequested,
    commands.PauseRequested, commands.ResumeRequested,
)
# What a rank may send up its link (events/ranklink.py); its agent refuses anything else.
RANK_TYPES: tuple[type[RankEvent], ...] = tuple(t for t in ALL_TYPES if issubclass(t, RankEvent)
                                                and t.__name__ in RANK_TELEMETRY)
