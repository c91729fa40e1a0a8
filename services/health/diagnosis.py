"""What caused a loss spike, judged after its rollback: data, optimisation or hardware (SpikeDiagnosed).

The evidence, in the order it arrives: every rank's losses over the spike (did one rank's leave its data-parallel
peers'?), the re-run of the spike's batches from the rollback's checkpoint when policy.spike_diagnosis asks for
one (did the same batches spike again?), and the steps after the skip (did it come back on other batches at the
same point?). A re-run that does not spike again clears the data and the optimisation, which are both
deterministic functions of the checkpoint and the batches; what is left is a fault that passed: the hardware.
"""

import math
import statistics
from dataclasses import dataclass, field, replace

from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, SpikeDiagnosed, Verdict, spike_onset
from flightdeck.events.training import RolledBack, SpikeReplayed

DIVERGED = math.log(2.0)  # a rank whose loss is twice its peers' median (or more) over the spike left them
REPRODUCED = 0.5  # a re-run that rises this part of the spike's height above its baseline (log scale) spiked again
MAX_RANKS = 4096  # per-rank losses kept for a spike: what a verdict can cite, bounded


@dataclass(frozen=True, slots=True)
class Diverged:
    rank: int
    factor: float  # its loss over its peers' median, at `step`
    step: int


@dataclass(slots=True)
class Pending:
    """One spike's diagnosis, from its finding to its verdict."""

    finding: LossSpikeDetected
    horizon: int  # no spike again through this step after the skip: skipping its batches healed it
    nodes: dict[int, str]  # rank -> node, when it was found
    window: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> step -> loss over onset..step
    skip: tuple[int, int] = (0, 0)
    replay: str = "none"  # "none": not asked; "asked"; "done"; "lost" (the attempt ended first)
    reproduced: bool = False
    replay_losses: list[float] = field(default_factory=list)
    replay_s: float = 0.0
    evidence: list[str] = field(default_factory=list)
    checkpoint_id: str = ""
    landed: bool = False  # the rollback's skip is in force (RolledBack, or a restart after it)
    through: int = -1  # rank 0's newest step since: no spike came back through it

    def clone(self) -> "Pending":
        return replace(self, window={r: dict(s) for r, s in self.window.items()}, nodes=dict(self.nodes),
                       replay_losses=list(self.replay_losses), evidence=list(self.evidence))


@dataclass(slots=True)
class Diagnoses:
    """A job's spike under diagnosis (one at a time: a spike while one is open is its recurrence)."""

    margin: int  # steps past a spike that count as "the same point" (the scheduler's incident reaches as far)
    open: Pending | None = None
    settled_until: int = -1  # a spike up to this step belongs to an incident already diagnosed

    def clone(self) -> "Diagnoses":
        return Diagnoses(margin=self.margin, open=self.open.clone() if self.open is not None else None,
                         settled_until=self.settled_until)

    def spike(self, ev: LossSpikeDetected, nodes: dict[int, str],
              window: dict[int, dict[int, float]]) -> SpikeDiagnosed | None:
        """A spike was found (`window`: each rank's losses of its steps so far): it opens a diagnosis, or is the open
        one's recurrence, which settles it."""
        p = self.open
        if p is None and spike_onset(ev) <= self.settled_until:  # the diagnosed incident's: judged once
            self.settled_until = max(self.settled_until, ev.step + self.margin)
            return None
        if p is not None and ev.event_id in p.evidence:
            return None  # read again
        if p is not None and spike_onset(ev) <= p.horizon:
            # Before the skip is in force it is the same excursion seen again; after it, the spike came back.
            return self._settle(recurred=ev) if p.landed else None
        done = self._settle() if p is not None else None
        self.open = Pending(finding=ev, horizon=ev.step + self.margin, nodes=dict(nodes), evidence=[ev.event_id],
                            window={r: dict(s) for r, s in list(window.items())[:MAX_RANKS]})
        return done

    def loss(self, rank: int, step: int, loss: float) -> None:
        """A rank's loss: kept when it is of the open spike's steps and the first for its step (the original run's,
        not the re-trained one's after the rollback)."""
        p = self.open
        if p is None or p.landed or not spike_onset(p.finding) <= step <= p.finding.step:
            return
        seen = p.window.get(rank)
        if seen is None:
            if len(p.window) >= MAX_RANKS:
                return
            seen = p.window[rank] = {}
        seen.setdefault(step, loss)

    def rollback(self, ev: RollbackRequested) -> None:
        p = self.open
        if p is None:
            return
        if ev.trigger_id == p.finding.event_id:
            p.skip, p.checkpoint_id = (ev.skip_from, ev.skip_to), ev.checkpoint_id
            p.replay = "asked" if ev.replay else "none"
            p.evidence.append(ev.event_id)
        elif p.replay == "asked":  # decided again (its checkpoint was bad) or overruled: the re-run will not come
            p.replay = "lost"

    def replayed(self, ev: SpikeReplayed) -> SpikeDiagnosed | None:
        p = self.open
        if p is None or ev.rank != 0 or p.replay != "asked" or ev.checkpoint_id != p.checkpoint_id:
            return None
        onset, f = spike_onset(p.finding), p.finding
        p.replay_losses = [x for i, x in enumerate(ev.losses) if onset <= ev.from_step + i <= f.step]
        p.replay_s, p.replay = ev.seconds, "done"
        p.evidence.append(ev.event_id)
        p.reproduced = reproduced(f, p.replay_losses)
        return None if p.reproduced else self._settle()

    def landed(self, ev: RolledBack) -> None:
        p = self.open
        if p is not None and ev.rank == 0 and ev.checkpoint_id == p.checkpoint_id:
            p.landed = True

    def restarted(self) -> None:
        """A new attempt: it restores with the rollback's skip in force, and no re-run is coming."""
        p = self.open
        if p is not None:
            p.landed = p.landed or bool(p.checkpoint_id)
            if p.replay == "asked":
                p.replay = "lost"

    def stepped(self, step: int) -> SpikeDiagnosed | None:
        """Rank 0 ran `step`: past the horizon with the skip in force, the spike did not come back."""
        p = self.open
        if p is not None and p.landed:
            p.through = max(p.through, step)
            if step > p.horizon:
                return self._settle()
        return None

    def ended(self) -> SpikeDiagnosed | None:
        """The job ended: what the evidence says so far."""
        return self._settle() if self.open is not None else None

    def _settle(self, recurred: LossSpikeDetected | None = None) -> SpikeDiagnosed:
        p, self.open = self.open, None
        assert p is not None
        self.settled_until = max(self.settled_until, p.horizon,
                                 recurred.step + self.margin if recurred is not None else -1)
        if recurred is not None:
            p.evidence.append(recurred.event_id)
        verdict, reason, suspects = judge(p, recurred)
        f, diverged = p.finding, divergence(p.window)
        return SpikeDiagnosed(
            job_id=f.job_id, rank=0, attempt=f.attempt, evidence=p.evidence, finding_id=f.event_id, step=f.step,
            onset=spike_onset(f), verdict=verdict, reason=reason, replayed=p.replay == "done",
            reproduced=p.replay == "done" and p.reproduced, replay_losses=p.replay_losses, replay_s=p.replay_s,
            diverged_rank=diverged.rank if diverged is not None else -1, suspect_nodes=suspects,
            recurred_at=recurred.step if recurred is not None else -1)


def reproduced(f: LossSpikeDetected, replay: list[float]) -> bool:
    """Whether the re-run's losses over the spike's steps rose most of the way to the spike again (log scale)."""
    finite = [x for x in replay if math.isfinite(x) and x > 0]
    if len(finite) < len([x for x in replay if not math.isnan(x)]):
        return True  # an infinite loss in the re-run: it blew up again
    if not finite or f.baseline <= 0:
        return False
    spike = max([f.loss, *[x for x in f.losses if math.isfinite(x)]])
    height = math.log(spike / f.baseline) if spike > 0 else 0.0
    return height > 0 and math.log(max(finite) / f.baseline) >= REPRODUCED * height


def divergence(window: dict[int, dict[int, float]]) -> Diverged | None:
    """The one rank whose loss rose to twice its peers' median or more over the spike while no other did."""
    excess: dict[int, tuple[float, int]] = {}
    for rank, steps in window.items():
        best = (-math.inf, -1)
        for step, loss in steps.items():
            peers = [s[step] for r, s in window.items() if r != rank and step in s]
            peers = [x for x in peers if math.isfinite(x) and x > 0]
            if not peers or not (loss > 0):
                continue
            rel = math.log(loss / statistics.median(peers)) if math.isfinite(loss) else math.inf
            best = max(best, (rel, step))
        if best[1] >= 0:
            excess[rank] = best
    over = [r for r, (rel, _) in excess.items() if rel >= DIVERGED]
    if len(over) != 1:
        return None
    rel, step = excess[over[0]]
    return Diverged(rank=over[0], factor=math.exp(min(rel, 700.0)), step=step)


def judge(p: Pending, recurred: LossSpikeDetected | None) -> tuple[Verdict, str, list[str]]:
    """The verdict, why in words, and the nodes a hardware verdict points at."""
    f, onset = p.finding, spike_onset(p.finding)
    where = f"the spike over steps {onset}-{f.step}" if onset < f.step else f"the spike at step {f.step}"
    skipped = f"batches [{p.skip[0]}, {p.skip[1]})" if p.skip[1] > p.skip[0] else "its batches"
    d = divergence(p.window)
    rank_line = (f"; rank {d.rank}'s loss left its data-parallel peers' ({d.factor:.3g}x their median at step "
                 f"{d.step}{', on ' + p.nodes[d.rank] if p.nodes.get(d.rank) else ''})" if d is not None else
                 "; every rank's loss rose together" if len(p.window) > 1 else "")
    rerun = ""
    if p.replay == "done":
        peak = max((x for x in p.replay_losses if math.isfinite(x)), default=math.nan)
        rerun = (f"; training the same batches again from {p.checkpoint_id} "
                 f"{'spiked again' if p.reproduced else 'did not spike'} (highest loss {peak:.4g} against the "
                 f"spike's {f.loss:.4g} and a median of {f.baseline:.4g}, in {p.replay_s:.1f} s)")
    if recurred is not None:
        return "optimisation", (
            f"{where} came back at step {recurred.step} after {skipped} were skipped: it comes with this point of the "
            f"training (learning rate, growing gradient norms), not with those batches{rerun}{rank_line}; lower "
            f"train.lr or warm up longer"), []
    if p.replay == "done" and not p.reproduced:
        suspects = ([p.nodes[d.rank]] if d is not None and p.nodes.get(d.rank)
                    else sorted({n for n in p.nodes.values() if n}))
        named = ", ".join(suspects) or "the job's nodes"
        return "hardware", (
            f"{where} did not come back when its batches were trained again, so neither the data nor the "
            f"optimisation made it: a fault that passed{rerun}{rank_line}; suspect {named}: run its self-check "
            f"(python -m flightdeck.trainer.selfcheck) or cordon it (flightdeck cordon)"), suspects
    if p.replay == "done" and p.through >= 0:
        share = f" (in rank {d.rank}'s share of them)" if d is not None else ""
        return "data", (
            f"{where} came back when batches from step {onset} were trained again, and not after {skipped} were "
            f"skipped (none through step {p.through}): the data in those batches{share}{rerun}"), []
    if p.replay == "done":
        return "undetermined", (f"{where} came back when its batches were trained again, so the data or the "
                                f"optimisation made it; the job ended before skipping them could tell which{rerun}"
                                f"{rank_line}"), []
    why = {"none": "its batches were not trained again (policy.spike_diagnosis is off)",
           "asked": "the re-run of its batches had not reported when the job ended",
           "lost": "the re-run of its batches did not finish (the attempt ended or the rollback was decided again)"}
    healed = (f"skipping {skipped} healed it (no spike through step {p.through})" if p.through >= 0
              else "the job ended before its skip was tried")
    return "undetermined", f"{where}: {healed}; {why[p.replay]}, so bad data and a hardware fault that passed " \
        f"cannot be told apart{rank_line}", []
