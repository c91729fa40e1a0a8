"""Who authors each event type: the part of the wire contract that says who may publish what. The broker's
permissions (services/shell/security/permissions.py) and the AsyncAPI document (events/asyncapi.py) are both
derived from these tables, so neither can drift from the other.

Roles: the six services by name, `agent` (a node agent), `console` (a person, through the CLI or the client).
A job's ranks (`trainer`) author the telemetry types not listed under TELEMETRY_TYPES; their node agent publishes
them (RANK_TELEMETRY), checked against the rank it started: no rank holds a broker credential.
"""

# The event types each producer authors: a type listed under one producer is a decision no one else may
# publish; one listed under several (a pause: a person's, or the scheduler's when it leaves a rollback to the
# operator) any of them may. Scheduling decisions are the scheduler's alone (services/scheduler/tx.py emits them).
JOB_TYPES: dict[str, tuple[str, ...]] = {
    "scheduler": ("JobQueued", "AllocationRequested", "AllocationReleased", "JobResumed", "JobPhaseChanged",
                  "JobPreempted", "JobCompleted", "JobFailed", "JobCancelled", "StopRequested", "RollbackRequested",
                  "PauseRequested"),  # a spike rollback past policy.max_skip_fraction pauses for the operator
    "resources": ("AllocationGranted", "AllocationDenied"),
    "checkpoints": ("CheckpointCommitted", "CheckpointFailed", "CheckpointPending", "CheckpointDeleted",
                    "CheckpointScrubbed", "CheckpointsFailing", "CheckpointsRecovered", "FinalStateUnsaved",
                    "FinalStateSaved"),
    "health": ("RankLost", "RankHung", "StragglerDetected", "NonFiniteLoss", "LossSpikeDetected", "SpikeDiagnosed",
               "InexactRestore", "LossOutlier"),
    "resharder": ("ReshardPlanned",),
    "archiver": ("HistoryArchived",),
    "agent": ("WorkersStarted", "WorkersExited", "CheckpointRejected"),
    # A person's requests: submit and cancel jobs, ask ranks to checkpoint, pause or resume.
    "console": ("JobSubmitted", "CancelRequested", "CheckpointRequested", "PauseRequested", "ResumeRequested",
                "RollbackAsked", "CheckpointAdopted"),
}
NODE_TYPES: dict[str, tuple[str, ...]] = {
    "resources": ("NodeCordoned", "NodeUncordoned"),  # a loss cordon lifted when the node is back (resources core)
    "health": ("NodeLost",),
    "agent": ("NodeRegistered", "NodeHeartbeat", "SelfCheckPassed", "SelfCheckFailed"),
    "console": ("NodeCordoned", "NodeUncordoned"),  # an operator cordons by hand too
}
# What a job's ranks author and their node agent publishes for them, for any job (services/agent/links.py checks
# each against the rank that sent it). It starts any job's ranks already, so this trusts it with nothing new.
RANK_TELEMETRY = ("StepCompleted", "Heartbeat", "RankFault", "FaultInjected", "RolledBack", "RankStarted",
                  "SpikeReplayed", "CheckpointStaged", "CheckpointRefused", "SnapshotsOff", "ModelRegistered")
# Telemetry a producer other than the job's ranks publishes, for any job: a node agent relays its ranks'
# heartbeats in one batch per node (events/heartbeats.py), and their own telemetry.
TELEMETRY_TYPES: dict[str, tuple[str, ...]] = {"agent": ("RankHeartbeats", "ShardsUploaded", *RANK_TELEMETRY)}
# A node agent's own telemetry, about no job (subjects.fleet_telemetry): its sign of life while it runs no ranks.
FLEET_TELEMETRY: dict[str, tuple[str, ...]] = {"agent": ("AgentAlive",)}
