"""A quality run's life: open it (a new run checked whole before anything is written, or one to resume),
its lock while the trainings run, what an interruption keeps.

`bench quality` is `open_quality`, then `QualitySession.run` under a progress bar, then the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness import policy
from harness.quality.choices import QualityChoices
from harness.quality.config import QualityConfig
from harness.quality.plan import build_quality_config
from harness.quality.sweep import sweep_quality
from harness.quality.trainings import keep_finished_runs, planned
from harness.store import rundir
from harness.store.storage import QUALITY_RESULTS, RunLock


@dataclass(frozen=True)
class QualityRequest:
    """What `bench quality` was asked, as checked command-line values. `choices`: a new run's (ignored when
    resuming: a run keeps its original options)."""

    choices: QualityChoices = QualityChoices()
    resume: Path | None = None
    out: Path | None = None
    imports: tuple[str, ...] = ()


@dataclass
class QualitySession:
    run_dir: Path
    config: QualityConfig

    @property
    def resume_command(self) -> str:
        return rundir.resume_command("quality", self.run_dir, self.config.imports)

    def kept(self) -> str:
        return f"finished trainings are kept in {self.run_dir / QUALITY_RESULTS}"

    def run(self, on_eval=None, on_start=None, before: Callable[[int, int], None] | None = None) -> list[dict]:
        """Every training not finished yet, under the run's lock (unfinished ones are redone whole).
        `before(total_steps, steps_done)` is called once the lock is held. Returns the run's rows."""
        with RunLock(self.run_dir):
            finished = keep_finished_runs(self.run_dir, self.config)
            steps = self.config.train.steps
            if before is not None:
                chains = sum(len(chain) for _, (*_, chain) in planned(self.config))
                before(chains * steps, len(finished) * steps)
            return sweep_quality(self.run_dir, self.config, on_eval=on_eval, on_start=on_start, finished=finished)


def open_quality(request: QualityRequest, say: Callable[[str], None] = print) -> QualitySession:
    """Open the quality run `request` asks for; ArgumentError for a value that is not allowed. Every
    value, and every variant with its options, is checked before anything is written."""
    if request.resume is not None:
        metadata = rundir.open_to_resume(request.resume, "quality", list(request.imports))
        config = QualityConfig.from_json(metadata["config"])
        policy.import_modules(list(config.imports))
        say(f"resuming {request.resume} with its original options (other options given now are ignored)")
        return QualitySession(request.resume, config)
    policy.import_modules(list(request.imports))
    config = build_quality_config(request.choices, list(request.imports))
    run_dir = rundir.new_run_dir(request.out, "quality-")
    rundir.start(run_dir, "quality", config.to_json(), variants=policy.recorded_facts(config.variants))
    return QualitySession(run_dir, config)
