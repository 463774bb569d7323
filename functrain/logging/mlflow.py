"""`MLflowWriter`: scalars as MLflow metrics (``pip install "functrain[mlflow]"``).

It talks to MLflow through an ``MlflowClient`` (not the global ``mlflow.start_run`` state), so it never
touches a run the user's own code has active. The run starts at the first write; its id is kept in
``log_dir/mlflow_run_id`` so that a resumed functrain run logs into the same MLflow run. A
``file:`` tracking URI (``tracking_uri="file:///path/mlruns"``) needs no server.

Example:
    >>> import tempfile  # doctest: +SKIP
    >>> with MLflowWriter(tempfile.mkdtemp(), tracking_uri="file:///tmp/mlruns") as writer:  # doctest: +SKIP
    ...     writer.write(1, {"train/loss": 0.5})
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from functrain.logging._optional import import_optional
from functrain.logging.writer import RunIdWriter, check_scalars

__all__ = ["MLflowWriter"]


class MLflowWriter(RunIdWriter):
    """``log_batch`` of one write's scalars (with their step) into an MLflow run; ends the run on close.

    Args:
        log_dir: the run's log folder (the MLflow run id is kept there).
        tracking_uri: where MLflow stores runs; default: MLflow's (``MLFLOW_TRACKING_URI``, ``./mlruns``).
        experiment: the experiment's name (created if missing); default: MLflow's default experiment.
        run_name, tags: of the MLflow run. ``params``: logged once as run parameters (e.g. the config).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        mlflow = import_optional("mlflow", "mlflow", "MLflowWriter")
        self._client_cls = mlflow.tracking.MlflowClient
        self._metric_cls = mlflow.entities.Metric
        self._param_cls = mlflow.entities.Param
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.params = dict(params or {})
        self.client: Any = None
        self.run_id: str | None = None
        super().__init__(log_dir, "mlflow_run_id", resume_step)

    def _open(self, resume_step: int | None) -> None:
        self.client = self._client_cls(tracking_uri=self.tracking_uri)
        self.run_id = self.stored_run_id(resume_step)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment_id = "0"
        if self.experiment is not None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
            )
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        self.store_run_id(self.run_id)
        if self.params:
            params = [self._param_cls(str(k), str(v)) for k, v in self.params.items()]
            self.client.log_batch(self.run_id, params=params)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = check_scalars(step, scalars)
        self._ensure_open()
        now = int(time.time() * 1000)
        metrics = [self._metric_cls(name, float(v), now, step) for name, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.client = None
